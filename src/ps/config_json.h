#pragma once
// TableConfig <-> JSON (create requests, describe replies, save manifests), and its checks.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "cohort/ps.h"

namespace cohort::ps {

// The names used in JSON, in the Python module and in messages; *_from_name throws InvalidArgument.
const char* optimizer_name(Optimizer o);
const char* init_name(Initializer i);
const char* storage_name(DataType t);
Optimizer optimizer_from_name(const std::string& name);
Initializer init_from_name(const std::string& name);
DataType storage_from_name(const std::string& name);

inline constexpr uint32_t kMaxDim = 1u << 20;             // floats per row
inline constexpr uint64_t kMaxDenseValues = uint64_t{1} << 44;  // rows x dim of a dense table

nlohmann::json config_to_json(const TableConfig& c);
// Throws InvalidArgument naming the first field that is missing, of another type, or out of range.
TableConfig config_from_json(const nlohmann::json& j);
// Throws InvalidArgument naming the first bad field.
void validate(const std::string& table, const TableConfig& c);
// "" when equal, else "dim 64 (asked: 32)" for the first field that differs.
std::string config_difference(const TableConfig& have, const TableConfig& asked);

}  // namespace cohort::ps
