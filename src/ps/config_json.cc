#include "ps/config_json.h"

#include <fmt/core.h>

#include <cmath>
#include <limits>
#include <utility>

#include "cohort/error.h"

namespace cohort::ps {

const char* optimizer_name(Optimizer o) {
  switch (o) {
    case Optimizer::kSgd: return "sgd";
    case Optimizer::kAdagrad: return "adagrad";
    case Optimizer::kAdam: return "adam";
  }
  return "?";
}
const char* init_name(Initializer i) {
  switch (i) {
    case Initializer::kZeros: return "zeros";
    case Initializer::kConstant: return "constant";
    case Initializer::kUniform: return "uniform";
  }
  return "?";
}
const char* storage_name(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    default: return "?";
  }
}

Optimizer optimizer_from_name(const std::string& o) {
  if (o == "sgd") return Optimizer::kSgd;
  if (o == "adagrad") return Optimizer::kAdagrad;
  if (o == "adam") return Optimizer::kAdam;
  throw InvalidArgument(fmt::format("optimizer '{}': expected sgd, adagrad or adam", o));
}

Initializer init_from_name(const std::string& i) {
  if (i == "zeros") return Initializer::kZeros;
  if (i == "constant") return Initializer::kConstant;
  if (i == "uniform") return Initializer::kUniform;
  throw InvalidArgument(fmt::format("init '{}': expected zeros, constant or uniform", i));
}

DataType storage_from_name(const std::string& s) {
  if (s == "float32") return DataType::kFloat32;
  if (s == "float16") return DataType::kFloat16;
  if (s == "bfloat16") return DataType::kBFloat16;
  throw InvalidArgument(fmt::format("storage '{}': expected float32, float16 or bfloat16", s));
}

nlohmann::json config_to_json(const TableConfig& c) {
  return nlohmann::json{{"dim", c.dim},
                        {"dense", c.dense},
                        {"rows", c.rows},
                        {"expected_rows", c.expected_rows},
                        {"storage", storage_name(c.storage)},
                        {"optimizer", optimizer_name(c.optimizer)},
                        {"lr", c.lr},
                        {"beta1", c.beta1},
                        {"beta2", c.beta2},
                        {"eps", c.eps},
                        {"initial_accumulator", c.initial_accumulator},
                        {"init", init_name(c.init)},
                        {"init_a", c.init_a},
                        {"init_b", c.init_b},
                        {"seed", c.seed}};
}

namespace {

// Strict fields: nlohmann's get<uint32_t>() would take -1 as 4294967295, 2^40 as 0 and 8.5 as 8, so
// a configuration from the wire or a file is read by type and range instead.
const nlohmann::json& field(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) throw InvalidArgument(fmt::format("'{}' is missing", name));
  return *it;
}

std::string shown(const nlohmann::json& v) {
  std::string text = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return text.size() > 40 ? text.substr(0, 40) + "..." : text;
}

uint64_t unsigned_field(const nlohmann::json& j, const char* name, uint64_t max) {
  const nlohmann::json& v = field(j, name);
  if (!v.is_number_unsigned() || v.get<uint64_t>() > max)
    throw InvalidArgument(fmt::format("'{}': expected an integer from 0 to {}, got {}", name, max, shown(v)));
  return v.get<uint64_t>();
}

float float_field(const nlohmann::json& j, const char* name) {
  const nlohmann::json& v = field(j, name);
  if (!v.is_number() || !std::isfinite(v.get<double>()) ||
      std::fabs(v.get<double>()) > double(std::numeric_limits<float>::max()))
    throw InvalidArgument(fmt::format("'{}': expected a finite float, got {}", name, shown(v)));
  return v.get<float>();
}

bool bool_field(const nlohmann::json& j, const char* name) {
  const nlohmann::json& v = field(j, name);
  if (!v.is_boolean()) throw InvalidArgument(fmt::format("'{}': expected true or false, got {}", name, shown(v)));
  return v.get<bool>();
}

std::string string_field(const nlohmann::json& j, const char* name) {
  const nlohmann::json& v = field(j, name);
  if (!v.is_string()) throw InvalidArgument(fmt::format("'{}': expected a string, got {}", name, shown(v)));
  return v.get<std::string>();
}

}  // namespace

TableConfig config_from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw InvalidArgument(fmt::format("expected a JSON object, got {}", shown(j)));
  TableConfig c;
  c.dim = uint32_t(unsigned_field(j, "dim", UINT32_MAX));
  c.dense = bool_field(j, "dense");
  c.rows = unsigned_field(j, "rows", UINT64_MAX);
  // Absent from manifests saved before it existed.
  c.expected_rows = j.contains("expected_rows") ? unsigned_field(j, "expected_rows", UINT64_MAX) : 0;
  c.storage = storage_from_name(string_field(j, "storage"));
  c.optimizer = optimizer_from_name(string_field(j, "optimizer"));
  c.lr = float_field(j, "lr");
  c.beta1 = float_field(j, "beta1");
  c.beta2 = float_field(j, "beta2");
  c.eps = float_field(j, "eps");
  c.initial_accumulator = float_field(j, "initial_accumulator");
  c.init = init_from_name(string_field(j, "init"));
  c.init_a = float_field(j, "init_a");
  c.init_b = float_field(j, "init_b");
  c.seed = unsigned_field(j, "seed", UINT64_MAX);
  return c;
}

void validate(const std::string& table, const TableConfig& c) {
  auto bad = [&](const std::string& what) { throw InvalidArgument(fmt::format("table '{}': {}", table, what)); };
  if (c.dim == 0 || c.dim > kMaxDim) bad(fmt::format("dim {}: expected 1 to {}", c.dim, kMaxDim));
  if (c.dense && c.rows == 0) bad("a dense table needs rows > 0");
  if (!c.dense && c.rows != 0) bad("rows is for dense tables (sparse tables grow on first touch)");
  // Bounds that keep every size computed from a configuration (a shard's bytes, offsets) far from
  // overflowing 64 bits, whoever sent it.
  if (c.dense && c.rows > kMaxDenseValues / c.dim)  // dim >= 1: checked above
    bad(fmt::format("{} rows of dim {}: a dense table holds at most 2^44 values (rows x dim)", c.rows, c.dim));
  if (c.dense && c.expected_rows != 0) bad("expected_rows is for sparse tables (a dense table's rows are all created at once)");
  if (c.expected_rows > (uint64_t{1} << 40)) bad(fmt::format("expected_rows {}: at most 2^40", c.expected_rows));
  if (c.storage != DataType::kFloat32 && c.storage != DataType::kFloat16 && c.storage != DataType::kBFloat16)
    bad("storage must be float32, float16 or bfloat16");
  if (c.optimizer != Optimizer::kSgd && c.optimizer != Optimizer::kAdagrad && c.optimizer != Optimizer::kAdam)
    bad("optimizer must be sgd, adagrad or adam");
  if (c.init != Initializer::kZeros && c.init != Initializer::kConstant && c.init != Initializer::kUniform)
    bad("init must be zeros, constant or uniform");
  if (!std::isfinite(c.lr) || c.lr < 0) bad(fmt::format("lr {}: expected a finite number >= 0", c.lr));
  for (auto [name, v] : {std::pair{"beta1", c.beta1}, std::pair{"beta2", c.beta2}, std::pair{"eps", c.eps},
                         std::pair{"initial_accumulator", c.initial_accumulator}, std::pair{"init_a", c.init_a},
                         std::pair{"init_b", c.init_b}})
    if (!std::isfinite(v)) bad(fmt::format("{} {}: expected a finite number", name, v));
  if (c.init == Initializer::kUniform && !(c.init_a < c.init_b))
    bad(fmt::format("uniform initializer needs init_a < init_b (got {} and {})", c.init_a, c.init_b));
}

std::string config_difference(const TableConfig& have, const TableConfig& asked) {
  auto a = config_to_json(have), b = config_to_json(asked);
  for (auto& [k, v] : a.items())
    if (b[k] != v) return fmt::format("{} {} (asked: {})", k, v.dump(), b[k].dump());
  return "";
}

}  // namespace cohort::ps
