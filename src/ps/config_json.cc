#include "ps/config_json.h"

#include <fmt/core.h>

#include <cmath>

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

TableConfig config_from_json(const nlohmann::json& j) {
  TableConfig c;
  c.dim = j.at("dim").get<uint32_t>();
  c.dense = j.at("dense").get<bool>();
  c.rows = j.at("rows").get<uint64_t>();
  c.expected_rows = j.value("expected_rows", uint64_t{0});  // absent from manifests saved before it existed
  c.storage = storage_from_name(j.at("storage").get<std::string>());
  c.optimizer = optimizer_from_name(j.at("optimizer").get<std::string>());
  c.lr = j.at("lr").get<float>();
  c.beta1 = j.at("beta1").get<float>();
  c.beta2 = j.at("beta2").get<float>();
  c.eps = j.at("eps").get<float>();
  c.initial_accumulator = j.at("initial_accumulator").get<float>();
  c.init = init_from_name(j.at("init").get<std::string>());
  c.init_a = j.at("init_a").get<float>();
  c.init_b = j.at("init_b").get<float>();
  c.seed = j.at("seed").get<uint64_t>();
  return c;
}

void validate(const std::string& table, const TableConfig& c) {
  auto bad = [&](const std::string& what) { throw InvalidArgument(fmt::format("table '{}': {}", table, what)); };
  if (c.dim == 0 || c.dim > (1u << 20)) bad(fmt::format("dim {}: expected 1 to 1048576", c.dim));
  if (c.dense && c.rows == 0) bad("a dense table needs rows > 0");
  if (!c.dense && c.rows != 0) bad("rows is for dense tables (sparse tables grow on first touch)");
  if (c.dense && c.expected_rows != 0) bad("expected_rows is for sparse tables (a dense table's rows are all created at once)");
  if (c.expected_rows > (uint64_t{1} << 40)) bad(fmt::format("expected_rows {}: at most 2^40", c.expected_rows));
  if (c.storage != DataType::kFloat32 && c.storage != DataType::kFloat16 && c.storage != DataType::kBFloat16)
    bad("storage must be float32, float16 or bfloat16");
  if (!std::isfinite(c.lr) || c.lr < 0) bad(fmt::format("lr {}: expected a finite number >= 0", c.lr));
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
