#include "launch/parsers.h"

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/core.h>

#include <cctype>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "common/strings.h"

namespace cohort::launch {
namespace {

bool parse_int_text(const std::string& text, long long& out) {
  if (text.empty()) return false;
  size_t i = 0;
  if (text[0] == '-' || text[0] == '+') i = 1;
  if (i == text.size()) return false;
  for (size_t j = i; j < text.size(); ++j)
    if (!std::isdigit(static_cast<unsigned char>(text[j]))) return false;
  try {
    out = std::stoll(text);
  } catch (...) {
    return false;
  }
  return true;
}

// Why `host` cannot be a host name or address, or nullopt. Host names are letters, digits, '-' and
// '.' (RFC 1123; '_' too, which some clusters use); IPv6 addresses are hex digits, ':' and '.'
// (an embedded IPv4), with an optional "%zone".
std::optional<std::string> host_name_problem(const std::string& host) {
  if (host.empty()) return "empty";
  if (host.size() > 253) return "longer than 253 characters";
  const bool v6 = host.find(':') != std::string::npos;
  for (char c : host) {
    const auto u = static_cast<unsigned char>(c);
    const bool ok = v6 ? (std::isxdigit(u) || c == ':' || c == '.' || c == '%' || std::isalnum(u))
                       : (std::isalnum(u) || c == '-' || c == '.' || c == '_');
    if (!ok) return fmt::format("'{}' cannot appear in one", std::string(1, c));
  }
  if (!v6 && (host.front() == '-' || host.front() == '.')) return fmt::format("it starts with '{}'", host.front());
  return std::nullopt;
}

void add_host(std::vector<HostSlots>& hosts, HostSlots h) {
  for (auto& e : hosts) {
    if (e.host == h.host) {
      e.slots += h.slots;
      if (h.max_slots) e.max_slots = std::max(e.max_slots, h.max_slots);
      return;
    }
  }
  hosts.push_back(std::move(h));
}

}  // namespace

int parse_int_at_least(const std::string& text, const std::string& what, int min) {
  long long v = 0;
  if (!parse_int_text(std::string(str::trim(text)), v) || v < min || v > 1'000'000'000)
    throw ConfigError(fmt::format("{}={}: expected an integer >= {}", what, text, min));
  return static_cast<int>(v);
}

std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& origin) {
  std::vector<HostSlots> hosts;
  auto lines = str::split(text, '\n', /*keep_empty=*/true);
  for (size_t n = 0; n < lines.size(); ++n) {
    std::string line = lines[n];
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    // Tabs and spaces separate fields alike.
    for (auto& c : line)
      if (c == '\t' || c == '\r') c = ' ';
    auto fields = str::split(str::trim(line), ' ');
    if (fields.empty()) continue;
    std::string where = fmt::format("{}:{}", origin, n + 1);
    HostSlots h;
    h.host = fields[0];
    if (h.host.find('=') != std::string::npos)
      throw ConfigError(fmt::format("{}: '{}': expected a host name first, then slots=N", where, h.host));
    // MPICH's "host:N" (and "[v6]:N"), as -H writes it.
    if (auto colon = h.host.rfind(':'); colon != std::string::npos &&
                                        (h.host.front() == '[' || h.host.find(':') == colon)) {
      auto listed = parse_host_list(h.host, where);
      h.host = listed.front().host;
      h.slots = listed.front().slots;
    }
    // Judge the name before the fields: on a line of words that are no hostfile ("!!bad line here")
    // the first word is what is wrong, not the second.
    if (auto why = host_name_problem(h.host))
      throw ConfigError(fmt::format("{}: '{}' is not a host name ({}); expected lines of 'HOST [slots=N] [max_slots=M]'",
                                    where, h.host, *why));
    for (size_t f = 1; f < fields.size(); ++f) {
      const std::string& kv = fields[f];
      auto eq = kv.find_first_of("=:");
      if (eq == std::string::npos)
        throw ConfigError(fmt::format("{}: '{}': expected slots=N or max_slots=M", where, kv));
      std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
      long long v = 0;
      if (key == "slots" || key == "max_slots" || key == "max-slots") {
        if (!parse_int_text(value, v) || v < 1 || v > 1'000'000)
          throw ConfigError(fmt::format("{}: {}: expected a positive number of slots", where, kv));
        (key == "slots" ? h.slots : h.max_slots) = static_cast<int>(v);
      } else {
        throw ConfigError(fmt::format("{}: unknown field '{}' (expected slots=N or max_slots=M)", where, key));
      }
    }
    if (h.max_slots && h.max_slots < h.slots)
      throw ConfigError(fmt::format("{}: max_slots={} is smaller than slots={}", where, h.max_slots, h.slots));
    add_host(hosts, std::move(h));
  }
  if (hosts.empty()) throw ConfigError(fmt::format("{}: no hosts (only comments or blank lines)", origin));
  return hosts;
}

std::vector<HostSlots> parse_host_list(const std::string& text, const std::string& origin) {
  std::vector<HostSlots> hosts;
  for (const auto& raw : str::split(text, ',', /*keep_empty=*/true)) {
    std::string item(str::trim(raw));
    if (item.empty()) throw ConfigError(fmt::format("{} '{}': empty host name", origin, text));
    HostSlots h;
    // "[v6]:N", "host:N" or "host"
    size_t colon = std::string::npos;
    if (item.front() == '[') {
      auto close = item.find(']');
      if (close == std::string::npos) throw ConfigError(fmt::format("{} '{}': unclosed '['", origin, item));
      h.host = item.substr(1, close - 1);
      if (close + 1 < item.size()) {
        if (item[close + 1] != ':') throw ConfigError(fmt::format("{} '{}': expected ':N' after ']'", origin, item));
        colon = close + 1;
      }
    } else {
      colon = item.rfind(':');
      if (colon != std::string::npos && item.find(':') != colon)
        throw ConfigError(fmt::format("{} '{}': write an IPv6 address as [addr]:N", origin, item));
      h.host = item.substr(0, colon);
    }
    if (colon != std::string::npos) {
      long long v = 0;
      std::string count = item.substr(colon + 1);
      if (!parse_int_text(count, v) || v < 1 || v > 1'000'000)
        throw ConfigError(fmt::format("{} '{}': slot count '{}' must be a positive number", origin, item, count));
      h.slots = static_cast<int>(v);
    }
    if (h.host.empty()) throw ConfigError(fmt::format("{} '{}': empty host name", origin, item));
    if (auto why = host_name_problem(h.host))
      throw ConfigError(fmt::format("{} '{}': '{}' is not a host name ({})", origin, item, h.host, *why));
    add_host(hosts, std::move(h));
  }
  return hosts;
}

// More nodes than any Slurm cluster has: a list that expands past it is an error, not an allocation
// of gigabytes ("n[0-99999]r[0-99999]" is 10^10 names; found by fuzz/launch_parsers_fuzz.cc).
constexpr size_t kMaxListedNodes = 100000;

std::vector<std::string> expand_slurm_nodelist(const std::string& text) {
  // Split at top-level commas (commas inside [...] belong to a range list).
  std::vector<std::string> items;
  std::string cur;
  int depth = 0;
  for (char c : text) {
    if (c == '[') ++depth;
    if (c == ']') {
      if (--depth < 0) throw ConfigError(fmt::format("Slurm node list '{}': unbalanced ']'", text));
    }
    if (c == ',' && depth == 0) {
      items.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) throw ConfigError(fmt::format("Slurm node list '{}': unclosed '['", text));
  items.push_back(cur);

  std::vector<std::string> out;
  for (auto& raw : items) {
    std::string item(str::trim(raw));
    if (item.empty()) throw ConfigError(fmt::format("Slurm node list '{}': empty entry", text));
    // Expand bracket groups left to right (a name may have several: rack[1-2]-n[1-2]).
    std::vector<std::string> names{""};
    size_t pos = 0;
    while (pos < item.size()) {
      auto open = item.find('[', pos);
      std::string literal = item.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      for (auto& n : names) n += literal;
      if (open == std::string::npos) break;
      auto close = item.find(']', open);
      std::string ranges = item.substr(open + 1, close - open - 1);
      std::vector<std::string> suffixes;
      for (const auto& r : str::split(ranges, ',', true)) {
        std::string part(str::trim(r));
        auto dash = part.find('-');
        std::string lo_s = part.substr(0, dash), hi_s = dash == std::string::npos ? lo_s : part.substr(dash + 1);
        long long lo = 0, hi = 0;
        if (!parse_int_text(lo_s, lo) || !parse_int_text(hi_s, hi) || lo < 0 || hi < lo || hi - lo > 100000)
          throw ConfigError(fmt::format("Slurm node list '{}': '[{}]': '{}' is not a number or range such as 01-04",
                                        text, ranges, part));
        size_t width = lo_s.size();
        for (long long v = lo; v <= hi; ++v) suffixes.push_back(fmt::format("{:0{}}", v, width));
      }
      if (names.size() * suffixes.size() + out.size() > kMaxListedNodes)
        throw ConfigError(fmt::format("Slurm node list '{}': expands to more than {} nodes", text, kMaxListedNodes));
      std::vector<std::string> next;
      for (const auto& n : names)
        for (const auto& s : suffixes) next.push_back(n + s);
      names = std::move(next);
      pos = close + 1;
    }
    out.insert(out.end(), names.begin(), names.end());
  }
  return out;
}

std::vector<int> expand_slurm_counts(const std::string& text, const std::string& what) {
  std::vector<int> out;
  for (const auto& raw : str::split(text, ',', true)) {
    std::string item(str::trim(raw));
    int repeat = 1;
    if (auto paren = item.find("(x"); paren != std::string::npos) {
      if (item.back() != ')') throw ConfigError(fmt::format("{}={}: '{}': expected N(xM)", what, text, item));
      repeat = parse_int_at_least(item.substr(paren + 2, item.size() - paren - 3), what, 1);
      item.resize(paren);
    }
    int v = parse_int_at_least(item, what, 0);
    if (out.size() + static_cast<size_t>(repeat) > kMaxListedNodes)
      throw ConfigError(fmt::format("{}={}: more than {} entries", what, text, kMaxListedNodes));
    for (int i = 0; i < repeat; ++i) out.push_back(v);
  }
  return out;
}

namespace {
// A rank table field that is a decimal string ("3") or a number (3).
int table_int(const nlohmann::json& j, const std::string& field, const std::string& where) {
  if (!j.is_object() || !j.contains(field))
    throw ConfigError(fmt::format("{}: missing \"{}\"", where, field));
  const auto& v = j.at(field);
  if (v.is_number_integer() && v.get<long long>() >= 0 && v.get<long long>() <= 1 << 24) return v.get<int>();
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (!s.empty() && s.size() <= 8 && s.find_first_not_of("0123456789") == std::string::npos) return std::stoi(s);
  }
  throw ConfigError(fmt::format("{}.{}: {} is not a number >= 0", where, field, v.dump()));
}
std::string table_string(const nlohmann::json& j, const std::string& field, const std::string& where) {
  if (!j.is_object() || !j.contains(field) || !j.at(field).is_string() || j.at(field).get_ref<const std::string&>().empty())
    throw ConfigError(fmt::format("{}: missing \"{}\" (a non-empty string)", where, field));
  return j.at(field).get<std::string>();
}
const nlohmann::json& table_list(const nlohmann::json& j, const std::string& field, const std::string& where) {
  if (!j.is_object() || !j.contains(field) || !j.at(field).is_array() || j.at(field).empty())
    throw ConfigError(fmt::format("{}: missing \"{}\" (a non-empty list)", where, field));
  return j.at(field);
}
}  // namespace

RankTable parse_rank_table(const std::string& text, const std::string& origin) {
  const std::string top = "RANK_TABLE_FILE " + origin;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", top, e.what()));
  }
  if (!j.is_object()) throw ConfigError(fmt::format("{}: expected an object with server_list or group_list", top));
  RankTable t;
  auto add_device = [&](RankTableServer& server, const nlohmann::json& d, int rank_id, const std::string& where) {
    RankTableDevice dev;
    dev.device_id = table_int(d, "device_id", where);
    if (d.contains("device_ip") && d.at("device_ip").is_string()) dev.device_ip = d.at("device_ip").get<std::string>();
    dev.rank_id = rank_id;
    for (const auto& other : server.devices)
      if (other.device_id == dev.device_id)
        throw ConfigError(fmt::format("{}.device_id: device {} appears twice on server {}", where, dev.device_id,
                                      server.server_id));
    server.devices.push_back(dev);
  };
  if (j.contains("server_list")) {
    t.layout = "1.0";
    const auto& list = table_list(j, "server_list", top);
    for (size_t s = 0; s < list.size(); ++s) {
      const std::string where = fmt::format("{}: server_list[{}]", top, s);
      RankTableServer server;
      server.server_id = table_string(list[s], "server_id", where);
      const auto& devices = table_list(list[s], "device", where);
      for (size_t d = 0; d < devices.size(); ++d) {
        const std::string dw = fmt::format("{}.device[{}]", where, d);
        add_device(server, devices[d], table_int(devices[d], "rank_id", dw), dw);
      }
      t.servers.push_back(std::move(server));
    }
    if (j.contains("server_count")) {
      int count = table_int(j, "server_count", top);
      if (count != static_cast<int>(t.servers.size()))
        throw ConfigError(fmt::format("{}: server_count {} but server_list has {} entries", top, count,
                                      t.servers.size()));
    }
  } else if (j.contains("group_list")) {
    // 0.x: one instance per rank, each naming its server; instances of one server become its devices.
    t.layout = "0.x";
    const auto& groups = table_list(j, "group_list", top);
    if (groups.size() != 1)
      throw ConfigError(fmt::format("{}: group_list has {} groups; cohort reads the one world group", top,
                                    groups.size()));
    const std::string gw = top + ": group_list[0]";
    const auto& instances = table_list(groups[0], "instance_list", gw);
    for (size_t i = 0; i < instances.size(); ++i) {
      const std::string where = fmt::format("{}.instance_list[{}]", gw, i);
      std::string server_id = table_string(instances[i], "server_id", where);
      int rank_id = table_int(instances[i], "rank_id", where);
      const auto& devices = table_list(instances[i], "devices", where);
      if (devices.size() != 1)
        throw ConfigError(fmt::format("{}.devices: {} entries; an instance is one rank on one device", where,
                                      devices.size()));
      auto it = std::find_if(t.servers.begin(), t.servers.end(),
                             [&](const RankTableServer& s) { return s.server_id == server_id; });
      if (it == t.servers.end()) {
        t.servers.push_back(RankTableServer{server_id, {}});
        it = t.servers.end() - 1;
      }
      add_device(*it, devices[0], rank_id, where + ".devices[0]");
    }
    if (groups[0].contains("instance_count")) {
      int count = table_int(groups[0], "instance_count", gw);
      if (count != static_cast<int>(instances.size()))
        throw ConfigError(fmt::format("{}: instance_count {} but instance_list has {} entries", gw, count,
                                      instances.size()));
    }
  } else {
    throw ConfigError(fmt::format("{}: expected server_list (version 1.0) or group_list (0.x)", top));
  }
  // Rank ids: 0..N-1, each once.
  for (const auto& s : t.servers) t.rank_size += static_cast<int>(s.devices.size());
  std::vector<int> seen(static_cast<size_t>(t.rank_size), 0);
  for (const auto& s : t.servers)
    for (const auto& d : s.devices) {
      if (d.rank_id >= t.rank_size)
        throw ConfigError(fmt::format("{}: rank_id {} on server {} is not below the {} ranks of the table", top,
                                      d.rank_id, s.server_id, t.rank_size));
      if (seen[static_cast<size_t>(d.rank_id)]++)
        throw ConfigError(fmt::format("{}: rank_id {} appears twice", top, d.rank_id));
    }
  return t;
}

int rank_table_node(const RankTable& table, const std::vector<std::string>& addresses) {
  for (size_t s = 0; s < table.servers.size(); ++s)
    for (const auto& a : addresses)
      if (table.servers[s].server_id == a) return static_cast<int>(s);
  return -1;
}

TfConfig parse_tf_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("TF_CONFIG: not valid JSON ({})", e.what()));
  }
  if (!j.is_object() || !j.contains("cluster") || !j["cluster"].is_object())
    throw ConfigError("TF_CONFIG: expected an object with \"cluster\" and \"task\"");
  if (!j.contains("task") || !j["task"].is_object() || !j["task"].contains("type") || !j["task"]["type"].is_string())
    throw ConfigError("TF_CONFIG: \"task\" must be an object with \"type\" and \"index\"");
  TfConfig cfg;
  size_t chiefs = 0;
  for (const char* role : {"chief", "master", "worker"}) {
    if (!j["cluster"].contains(role)) continue;
    const auto& list = j["cluster"][role];
    if (!list.is_array()) throw ConfigError(fmt::format("TF_CONFIG: cluster.{} must be a list of \"host:port\"", role));
    for (const auto& e : list) {
      if (!e.is_string()) throw ConfigError(fmt::format("TF_CONFIG: cluster.{} must be a list of \"host:port\"", role));
      cfg.nodes.push_back(e.get<std::string>());
    }
    if (std::string(role) != "worker") chiefs = cfg.nodes.size();
  }
  if (cfg.nodes.empty()) throw ConfigError("TF_CONFIG: cluster has no chief or worker entries");
  const size_t workers_end = cfg.nodes.size();
  if (j["cluster"].contains("ps")) {
    const auto& list = j["cluster"]["ps"];
    if (!list.is_array()) throw ConfigError("TF_CONFIG: cluster.ps must be a list of \"host:port\"");
    for (const auto& e : list) {
      if (!e.is_string()) throw ConfigError("TF_CONFIG: cluster.ps must be a list of \"host:port\"");
      cfg.nodes.push_back(e.get<std::string>());
    }
    cfg.ps_nodes = static_cast<int>(cfg.nodes.size() - workers_end);
  }
  std::string type = j["task"]["type"].get<std::string>();
  int index = 0;
  if (j["task"].contains("index")) {
    if (!j["task"]["index"].is_number_integer()) throw ConfigError("TF_CONFIG: task.index must be an integer");
    index = j["task"]["index"].get<int>();
  }
  if (type == "chief" || type == "master") {
    cfg.node_rank = index;
  } else if (type == "worker") {
    cfg.node_rank = static_cast<int>(chiefs) + index;
  } else if (type == "ps") {
    cfg.node_rank = static_cast<int>(workers_end) + index;
  } else {
    throw ConfigError(
        fmt::format("TF_CONFIG: task.type '{}' is not launched by cohort (expected chief, worker or ps)", type));
  }
  const size_t entries = type == "ps" ? static_cast<size_t>(cfg.ps_nodes)
                         : type == "worker" ? workers_end - chiefs
                                            : chiefs;
  const size_t first = type == "ps" ? workers_end : type == "worker" ? chiefs : 0;
  if (index < 0 || static_cast<size_t>(cfg.node_rank) >= first + entries)
    throw ConfigError(fmt::format("TF_CONFIG: task {} index {} is outside cluster.{} ({} entries)", type, index, type,
                                  entries));
  return cfg;
}

namespace {

template <typename T>
void merge(std::optional<Sourced<T>>& slot, T value, const std::string& source, const char* what) {
  if (!slot) {
    slot = Sourced<T>{std::move(value), source};
    return;
  }
  if (slot->value != value)
    throw ConfigError(fmt::format("conflicting {}: {} says {} but {} says {}", what, slot->source, slot->value, source,
                                  value));
}

const std::string* find(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

// "4", "gpu:4", "a100:4" -> 4
int gpu_count(const std::string& text, const std::string& what) {
  auto colon = text.rfind(':');
  return parse_int_at_least(colon == std::string::npos ? text : text.substr(colon + 1), what, 0);
}

std::string host_of(const std::string& host_port) {
  if (!host_port.empty() && host_port.front() == '[') return host_port.substr(1, host_port.find(']') - 1);
  auto colon = host_port.rfind(':');
  return colon == std::string::npos ? host_port : host_port.substr(0, colon);
}

}  // namespace

int slurm_store_port(const std::string& job_id, const std::string& step_id) {
  const int job = parse_int_at_least(job_id, "SLURM_JOB_ID", 0);
  const int step = parse_int_at_least(step_id, "SLURM_STEP_ID", 0);
  return 20000 + job % 1000 * 10 + step % 10;
}

std::optional<SlurmAllocation> read_slurm_allocation(const EnvMap& env) {
  const auto* id = find(env, "SLURM_JOB_ID");
  const auto* list = find(env, "SLURM_JOB_NODELIST");
  if (!id || !list || find(env, "SLURM_STEP_ID")) return std::nullopt;
  SlurmAllocation a;
  a.job_id = *id;
  if (const auto* me = find(env, "SLURMD_NODENAME")) a.this_node = *me;
  auto names = expand_slurm_nodelist(*list);
  // Slots: the tasks the allocation has on each node (sbatch/salloc --ntasks-per-node, -n), as mpirun
  // counts them; a GPU allocation without a task count has one slot per GPU.
  std::vector<int> slots;
  const auto* gpus = find(env, "SLURM_GPUS_PER_NODE");
  if (gpus && !find(env, "SLURM_NTASKS_PER_NODE") && gpu_count(*gpus, "SLURM_GPUS_PER_NODE") > 0) {
    slots.assign(names.size(), gpu_count(*gpus, "SLURM_GPUS_PER_NODE"));
    a.slots_source = "SLURM_GPUS_PER_NODE";
  } else if (const auto* t = find(env, "SLURM_TASKS_PER_NODE")) {
    slots = expand_slurm_counts(*t, "SLURM_TASKS_PER_NODE");
    a.slots_source = "SLURM_TASKS_PER_NODE";
  } else {
    slots.assign(names.size(), 1);
    a.slots_source = "one per node (SLURM_TASKS_PER_NODE not set)";
  }
  if (slots.size() != names.size())
    throw ConfigError(fmt::format("{} lists {} nodes but SLURM_JOB_NODELIST={} has {}", a.slots_source, slots.size(),
                                  *list, names.size()));
  for (size_t i = 0; i < names.size(); ++i) a.nodes.push_back(HostSlots{names[i], slots[i]});
  return a;
}

SchedulerInfo read_scheduler_env(const EnvMap& env, const std::vector<std::string>& addresses) {
  SchedulerInfo info;
  auto note = [&](const char* name) {
    if (info.scheduler_names.empty() || info.scheduler_names.back() != name) info.scheduler_names.push_back(name);
  };
  auto int_var = [&](std::optional<Sourced<int>>& slot, const std::string& name, int min, const char* what,
                     const char* scheduler) {
    if (const auto* v = find(env, name)) {
      merge(slot, parse_int_at_least(*v, name, min), name, what);
      note(scheduler);
    }
  };

  // Slurm, in a task of an srun step (`srun --ntasks-per-node=1 cohort run ...`): the step's nodes are
  // the job's nodes and this node is where SLURMD_NODENAME stands in the step's node list. (SLURM_NODEID
  // counts the job's nodes, not the step's: a step on part of the allocation would misplace it.)
  if (find(env, "SLURM_STEP_ID") && find(env, "SLURM_STEP_NODELIST")) {
    auto nodes = expand_slurm_nodelist(env.at("SLURM_STEP_NODELIST"));
    note("Slurm");
    merge(info.master_addr, nodes.front(), "SLURM_STEP_NODELIST (first node)", "master address");
    merge(info.nnodes, static_cast<int>(nodes.size()), "SLURM_STEP_NODELIST (node count)", "node count");
    int index = -1;
    if (const auto* me = find(env, "SLURMD_NODENAME")) {
      auto it = std::find(nodes.begin(), nodes.end(), *me);
      if (it == nodes.end())
        throw ConfigError(fmt::format("SLURMD_NODENAME={} is not in SLURM_STEP_NODELIST={}", *me,
                                      env.at("SLURM_STEP_NODELIST")));
      index = static_cast<int>(it - nodes.begin());
      merge(info.node_rank, index, "SLURMD_NODENAME in SLURM_STEP_NODELIST", "node rank");
    } else {
      int_var(info.node_rank, "SLURM_NODEID", 0, "node rank", "Slurm");
      if (info.node_rank) index = info.node_rank->value;
    }
    // One cohort per node: a second launcher on this node would start the same ranks again. The
    // usual cause: srun inherits the batch job's task count, and then ignores --ntasks-per-node=1.
    if (const auto* t = find(env, "SLURM_STEP_TASKS_PER_NODE"); t && index >= 0) {
      auto tasks = expand_slurm_counts(*t, "SLURM_STEP_TASKS_PER_NODE");
      if (static_cast<size_t>(index) < tasks.size() && tasks[static_cast<size_t>(index)] > 1)
        throw ConfigError(fmt::format(
            "srun started {} cohort launchers on node {} (SLURM_STEP_TASKS_PER_NODE={}); cohort run starts "
            "the node's workers itself and wants one launcher per node: srun --ntasks={} --ntasks-per-node=1 "
            "cohort run ... (or run cohort run once, without srun, in the batch script)",
            tasks[static_cast<size_t>(index)], nodes[static_cast<size_t>(index)], *t, nodes.size()));
    }
    if (const auto* g = find(env, "SLURM_GPUS_ON_NODE"); g && gpu_count(*g, "SLURM_GPUS_ON_NODE") > 0)
      merge(info.nproc_per_node, gpu_count(*g, "SLURM_GPUS_ON_NODE"), "SLURM_GPUS_ON_NODE", "processes per node");
    if (const auto* id = find(env, "SLURM_JOB_ID")) {
      merge(info.job_id, fmt::format("slurm-{}.{}", *id, env.at("SLURM_STEP_ID")), "SLURM_JOB_ID.SLURM_STEP_ID",
            "job id");
      info.default_master_port = Sourced<int>{slurm_store_port(*id, env.at("SLURM_STEP_ID")),
                                              "SLURM_JOB_ID and SLURM_STEP_ID (20000 + job % 1000 * 10 + step % 10)"};
    }
  } else if (find(env, "SLURM_NODEID") && (find(env, "SLURM_JOB_NODELIST") || find(env, "SLURM_NODELIST"))) {
    // Slurm variables without a step (set by hand, or by a platform that imitates Slurm): the job's.
    const char* list_var = find(env, "SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    auto nodes = expand_slurm_nodelist(env.at(list_var));
    note("Slurm");
    merge(info.master_addr, nodes.front(), std::string(list_var) + " (first node)", "master address");
    if (find(env, "SLURM_NNODES")) int_var(info.nnodes, "SLURM_NNODES", 1, "node count", "Slurm");
    else if (find(env, "SLURM_JOB_NUM_NODES")) int_var(info.nnodes, "SLURM_JOB_NUM_NODES", 1, "node count", "Slurm");
    else merge(info.nnodes, static_cast<int>(nodes.size()), std::string(list_var) + " (node count)", "node count");
    int_var(info.node_rank, "SLURM_NODEID", 0, "node rank", "Slurm");
    if (const auto* g = find(env, "SLURM_GPUS_ON_NODE"); g && gpu_count(*g, "SLURM_GPUS_ON_NODE") > 0) {
      merge(info.nproc_per_node, gpu_count(*g, "SLURM_GPUS_ON_NODE"), "SLURM_GPUS_ON_NODE", "processes per node");
    } else if (const auto* gp = find(env, "SLURM_GPUS_PER_NODE"); gp && gpu_count(*gp, "SLURM_GPUS_PER_NODE") > 0) {
      merge(info.nproc_per_node, gpu_count(*gp, "SLURM_GPUS_PER_NODE"), "SLURM_GPUS_PER_NODE", "processes per node");
    } else if (const auto* t = find(env, "SLURM_NTASKS_PER_NODE")) {
      merge(info.nproc_per_node, expand_slurm_counts(*t, "SLURM_NTASKS_PER_NODE").front(), "SLURM_NTASKS_PER_NODE",
            "processes per node");
    }
    if (const auto* id = find(env, "SLURM_JOB_ID")) merge(info.job_id, "slurm-" + *id, "SLURM_JOB_ID", "job id");
  }

  // Open MPI, when mpirun starts one cohort per node.
  int_var(info.nnodes, "OMPI_COMM_WORLD_SIZE", 1, "node count", "Open MPI");
  int_var(info.node_rank, "OMPI_COMM_WORLD_RANK", 0, "node rank", "Open MPI");

  // torchrun / Kubeflow PyTorchJob: WORLD_SIZE and RANK count nodes here.
  if (const auto* a = find(env, "MASTER_ADDR")) {
    merge(info.master_addr, *a, "MASTER_ADDR", "master address");
    note("torchrun/Kubeflow");
  }
  int_var(info.master_port, "MASTER_PORT", 1, "master port", "torchrun/Kubeflow");
  int_var(info.nnodes, "WORLD_SIZE", 1, "node count", "torchrun/Kubeflow");
  int_var(info.node_rank, "RANK", 0, "node rank", "torchrun/Kubeflow");
  if (const auto* a = find(env, "PET_MASTER_ADDR")) {
    merge(info.master_addr, *a, "PET_MASTER_ADDR", "master address");
    note("Kubeflow");
  }
  int_var(info.master_port, "PET_MASTER_PORT", 1, "master port", "Kubeflow");
  if (const auto* n = find(env, "PET_NNODES")) {
    // Elastic form "1:4" (Kubeflow's elastic PyTorchJob): an elastic job of 1 to 4 nodes.
    auto colon = n->rfind(':');
    const int max = parse_int_at_least(colon == std::string::npos ? *n : n->substr(colon + 1), "PET_NNODES", 1);
    merge(info.nnodes, max, "PET_NNODES", "node count");
    if (colon != std::string::npos) {
      const int min = parse_int_at_least(n->substr(0, colon), "PET_NNODES", 1);
      if (min > max) throw ConfigError(fmt::format("PET_NNODES={}: expected MIN:MAX with MIN <= MAX", *n));
      if (min < max) info.min_nodes = Sourced<int>{min, "PET_NNODES"};
    }
    note("Kubeflow");
  }
  if (const auto* e = find(env, "PET_RDZV_ENDPOINT")) {
    // host[:port] of the elastic rendezvous (torchrun's --rdzv-endpoint): cohort's store.
    auto colon = e->rfind(':');
    const bool has_port = colon != std::string::npos && e->find(':') == colon;
    const std::string host = has_port ? e->substr(0, colon) : *e;
    if (host.empty()) throw ConfigError(fmt::format("PET_RDZV_ENDPOINT={}: expected HOST[:PORT]", *e));
    merge(info.master_addr, host, "PET_RDZV_ENDPOINT", "master address");
    if (has_port) {
      const int port = parse_int_at_least(e->substr(colon + 1), "PET_RDZV_ENDPOINT's port", 1);
      if (port > 65535) throw ConfigError(fmt::format("PET_RDZV_ENDPOINT={}: the port is above 65535", *e));
      merge(info.master_port, port, "PET_RDZV_ENDPOINT", "master port");
    }
    note("Kubeflow");
  }
  if (const auto* p = find(env, "PET_NPROC_PER_NODE"); p && *p != "auto")
    int_var(info.nproc_per_node, "PET_NPROC_PER_NODE", 1, "processes per node", "Kubeflow");
  int_var(info.node_rank, "PET_NODE_RANK", 0, "node rank", "Kubeflow");

  // TI-ONE style platforms.
  int_var(info.nproc_per_node, "GPU_NUM_PER_NODE", 1, "processes per node", "TI-ONE");
  if (const auto* list = find(env, "NODE_LIST")) {
    auto hosts = parse_host_list(*list, "NODE_LIST");
    merge(info.nnodes, static_cast<int>(hosts.size()), "NODE_LIST (host count)", "node count");
    merge(info.master_addr, hosts.front().host, "NODE_LIST (first host)", "master address");
    int_var(info.node_rank, "INDEX", 0, "node rank", "TI-ONE");
    note("TI-ONE");
  }

  // TI-ONE's Ray mode: every node gets HEAD_ADDR, HEAD_PORT and RANK (0: the head). Kept apart from the
  // master address: they name Ray's head and its GCS port, which only a --ray job uses.
  if (const auto* a = find(env, "HEAD_ADDR")) {
    if (auto why = host_name_problem(*a))
      throw ConfigError(fmt::format("HEAD_ADDR={}: not a host name or address ({})", *a, *why));
    info.ray_head_addr = Sourced<std::string>{*a, "HEAD_ADDR"};
    note("TI-ONE (Ray)");
  }
  if (const auto* p = find(env, "HEAD_PORT")) {
    const int port = parse_int_at_least(*p, "HEAD_PORT", 1);
    if (port > 65535) throw ConfigError(fmt::format("HEAD_PORT={}: the port is above 65535", *p));
    info.ray_head_port = Sourced<int>{port, "HEAD_PORT"};
    note("TI-ONE (Ray)");
  }

  if (const auto* path = find(env, "RANK_TABLE_FILE")) {
    // Ascend: the table lists every server and its devices; this node is the server with one of
    // this host's addresses, unless another variable says which node this is.
    // A folder opens as a stream but reads nothing: say so rather than "not JSON".
    std::error_code ec;
    if (std::filesystem::is_directory(*path, ec))
      throw ConfigError(fmt::format("RANK_TABLE_FILE {}: cannot read it: it is a directory", *path));
    std::ifstream in(*path);
    // errno says why: no such file, permission denied.
    if (!in) throw ConfigError(fmt::format("RANK_TABLE_FILE {}: cannot read it: {}", *path, std::strerror(errno)));
    std::stringstream ss;
    ss << in.rdbuf();
    RankTable t = parse_rank_table(ss.str(), *path);
    const std::string src = "RANK_TABLE_FILE";
    merge(info.nnodes, static_cast<int>(t.servers.size()), src + " (server_list)", "node count");
    merge(info.master_addr, t.servers.front().server_id, src + " (first server_id)", "master address");
    const size_t per = t.servers.front().devices.size();
    for (const auto& s : t.servers)
      if (s.devices.size() != per)
        throw ConfigError(fmt::format("RANK_TABLE_FILE {}: server {} has {} devices but server {} has {}; cohort "
                                      "starts the same number of workers on every node",
                                      *path, s.server_id, s.devices.size(), t.servers.front().server_id, per));
    merge(info.nproc_per_node, static_cast<int>(per), src + " (devices per server)", "processes per node");
    const int node = rank_table_node(t, addresses);
    if (node >= 0) {
      merge(info.node_rank, node, src + " (server_id of this host)", "node rank");
    } else if (!info.node_rank && t.servers.size() > 1) {
      std::vector<std::string> ids;
      for (const auto& s : t.servers) ids.push_back(s.server_id);
      throw ConfigError(fmt::format("RANK_TABLE_FILE {}: no server_id is an address of this host ({}); servers: "
                                    "{} (or give --node-rank)",
                                    *path, str::join(addresses, ", "), str::join(ids, ", ")));
    }
    info.rank_table = std::move(t);
    note("Ascend rank table");
  }

  if (const auto* tf = find(env, "TF_CONFIG")) {
    auto cfg = parse_tf_config(*tf);
    merge(info.nnodes, static_cast<int>(cfg.nodes.size()), "TF_CONFIG (cluster size)", "node count");
    merge(info.node_rank, cfg.node_rank, "TF_CONFIG (task)", "node rank");
    if (cfg.ps_nodes > 0) info.ps_nodes = Sourced<int>{cfg.ps_nodes, "TF_CONFIG (cluster.ps)"};
    merge(info.master_addr, host_of(cfg.nodes.front()), "TF_CONFIG (first cluster entry)", "master address");
    const std::string& first = cfg.nodes.front();
    if (auto colon = first.rfind(':'); colon != std::string::npos && first.back() != ']')
      merge(info.master_port, parse_int_at_least(first.substr(colon + 1), "TF_CONFIG port", 1),
            "TF_CONFIG (first cluster entry)", "master port");
    note("TF_CONFIG");
  }
  // Found by the launcher parsers' fuzz target: MASTER_PORT=2959500 went through to the workers.
  if (info.master_port && info.master_port->value > 65535)
    throw ConfigError(fmt::format("{}: port {} is not between 1 and 65535", info.master_port->source,
                                  info.master_port->value));
  if (info.node_rank && info.nnodes && info.node_rank->value >= info.nnodes->value)
    throw ConfigError(fmt::format("node rank {} ({}) is not below the node count {} ({})", info.node_rank->value,
                                  info.node_rank->source, info.nnodes->value, info.nnodes->source));
  return info;
}

namespace {
// A small cursor for rank_reported_gone: each eat_* advances `i` past what it matched, or returns
// false (the caller then tries its next form from its own copy of the position).
struct Cursor {
  std::string_view s;
  size_t i;
  bool eat(std::string_view text) {
    if (s.substr(i, text.size()) != text) return false;
    i += text.size();
    return true;
  }
  bool eat_number(int* out = nullptr) {
    size_t j = i;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    if (j == i) return false;
    int value = 0;
    if (out && std::from_chars(s.data() + i, s.data() + j, value).ec != std::errc()) return false;
    if (out) *out = value;
    i = j;
    return true;
  }
  bool eat_parenthesised() {  // "(...)" without a ')' inside
    if (!eat("(")) return false;
    const size_t close = s.find(')', i);
    if (close == std::string_view::npos) return false;
    i = close + 1;
    return true;
  }
  bool at_word_end() const {
    return i == s.size() || !(std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_');
  }
};

bool word_starts_at(std::string_view s, size_t i) {
  return i == 0 || !(std::isalnum(static_cast<unsigned char>(s[i - 1])) || s[i - 1] == '_');
}

// "rank N [(job rank M) ]exited (code 0)" at `i`: M when given, else N.
std::optional<int> clean_exit_at(std::string_view s, size_t i) {
  Cursor c{s, i};
  int rank = 0, job_rank = -1;
  if (!c.eat("rank ") || !c.eat_number(&rank) || !c.eat(" ")) return std::nullopt;
  Cursor with_job = c;
  if (with_job.eat("(job rank ") && with_job.eat_number(&job_rank) && with_job.eat(") "))
    c = with_job;
  else
    job_rank = -1;
  if (!c.eat("exited (code 0)")) return std::nullopt;
  return job_rank >= 0 ? job_rank : rank;
}

// The transports' words at `i`: "shm: rank N (host) (pid P) exited during ", "lost rank N" (a whole
// number) or "rank N (host) left ".
std::optional<int> transport_gone_at(std::string_view s, size_t i) {
  int rank = 0;
  if (Cursor c{s, i}; c.eat("shm: rank ") && c.eat_number(&rank) && c.eat(" ") && c.eat_parenthesised() &&
                      c.eat(" (pid ") && c.eat_number() && c.eat(") exited during "))
    return rank;
  if (Cursor c{s, i}; c.eat("lost rank ") && c.eat_number(&rank) && c.at_word_end()) return rank;
  if (Cursor c{s, i}; c.eat("rank ") && c.eat_number(&rank) && c.eat(" ") && c.eat_parenthesised() && c.eat(" left "))
    return rank;
  return std::nullopt;
}
}  // namespace

std::optional<int> rank_reported_gone(std::string_view line) {
  for (size_t i = 0; i < line.size(); ++i)
    if (word_starts_at(line, i))
      if (auto rank = clean_exit_at(line, i)) return rank;
  for (size_t i = 0; i < line.size(); ++i)
    if (word_starts_at(line, i))
      if (auto rank = transport_gone_at(line, i)) return rank;
  return std::nullopt;
}

}  // namespace cohort::launch
