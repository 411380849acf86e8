#pragma once
// TableConfig <-> JSON (create requests, describe replies, save manifests), and its checks.

#include <nlohmann/json.hpp>

#include <string>

#include "cohort/ps.h"

namespace cohort::ps {

nlohmann::json config_to_json(const TableConfig& c);
TableConfig config_from_json(const nlohmann::json& j);  // throws nlohmann::json::exception
// Throws InvalidArgument naming the first bad field.
void validate(const std::string& table, const TableConfig& c);
// "" when equal, else "dim 64 (asked: 32)" for the first field that differs.
std::string config_difference(const TableConfig& have, const TableConfig& asked);

}  // namespace cohort::ps
