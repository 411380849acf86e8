#include "comm/pmix.h"

#include <dlfcn.h>
#include <unistd.h>
#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "common/env.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "store/auth.h"

namespace cohort::comm::pmix {
namespace {

const env::StringSetting kLibrary("COHORT_PMIX_LIBRARY", "",
                                  "path of libpmix.so to load under a PMIx launcher (default: libpmix.so.2, "
                                  "searched)");
// Also declared by the TCP transport; the registry keeps one entry.
const env::StringSetting kTcpAddr("COHORT_TCP_ADDR", "",
                                  "address peers on other hosts dial (default: first non-loopback IPv4)");

struct Loaded {
  abi::Api api{};
  bool ok = false;
  std::string why_not;
};

template <typename F>
void bind(void* handle, const char* symbol, F& slot, std::vector<std::string>& missing) {
  slot = reinterpret_cast<F>(dlsym(handle, symbol));
  if (!slot) missing.push_back(symbol);
}

// The first digits of PMIx_Get_version() ("OpenPMIx 4.2.2rc2, repo rev: ..."): the major version.
int major_version(const char* text) {
  if (!text) return -1;
  const char* p = text;
  while (*p && !(*p >= '0' && *p <= '9')) ++p;
  return *p ? std::atoi(p) : -1;
}

Loaded load_once() {
  Loaded out;
  std::vector<std::string> tried;
  void* h = nullptr;
  std::string path = kLibrary.get();
  auto try_open = [&](const std::string& candidate, int flags) {
    dlerror();
    h = dlopen(candidate.c_str(), flags);
    if (!h && !(flags & RTLD_NOLOAD)) {
      const char* e = dlerror();
      tried.push_back(e ? e : candidate + ": not loadable");
    }
    return h != nullptr;
  };
  if (!path.empty()) {
    try_open(path, RTLD_NOW | RTLD_LOCAL);
  } else {
    // The copy libmpi (or anything else in the process) already loaded first: one PMIx client per process.
    path = "libpmix.so.2";
    if (!try_open(path, RTLD_NOW | RTLD_NOLOAD) && !try_open(path, RTLD_NOW | RTLD_LOCAL)) {
#ifdef COHORT_PMIX_LIB_DIR
      path = std::string(COHORT_PMIX_LIB_DIR) + "/libpmix.so.2";  // where pkg-config found it at build time
      try_open(path, RTLD_NOW | RTLD_LOCAL);
#endif
    }
  }
  if (!h) {
    out.why_not = tried.empty() ? path + ": not loadable" : str::join(tried, "; ");
    return out;
  }
  std::vector<std::string> missing;
  bind(h, "PMIx_Init", out.api.Init, missing);
  bind(h, "PMIx_Finalize", out.api.Finalize, missing);
  bind(h, "PMIx_Put", out.api.Put, missing);
  bind(h, "PMIx_Commit", out.api.Commit, missing);
  bind(h, "PMIx_Fence", out.api.Fence, missing);
  bind(h, "PMIx_Get", out.api.Get, missing);
  bind(h, "PMIx_Error_string", out.api.Error_string, missing);
  bind(h, "PMIx_Get_version", out.api.Get_version, missing);
  if (!missing.empty()) {
    out.why_not = fmt::format("{} lacks {}", path, str::join(missing, ", "));
    return out;
  }
  // The structures declared in pmix.h are PMIx 3's and later's (PMIx 2's value union is smaller).
  const char* version = out.api.Get_version();
  if (major_version(version) < 3) {
    out.why_not = fmt::format("{} is PMIx '{}'; cohort needs PMIx 3 or later", path, version ? version : "?");
    return out;
  }
  out.ok = true;
  return out;
}

// Runs a blocking PMIx call on a thread of its own and waits at most `timeout` for it: PMIx's own waits
// have no end (PMIx_Init against a server that accepts the connection but never answers blocks for
// good). nullopt when time ran out; that thread then stays blocked inside libpmix, and the caller must
// not call PMIx again.
std::optional<abi::Status> bounded(std::function<abi::Status()> call, std::chrono::milliseconds timeout) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    abi::Status status = abi::kSuccess;
  };
  auto state = std::make_shared<State>();
  std::thread([state, call = std::move(call)] {
    abi::Status s = call();
    std::lock_guard<std::mutex> g(state->mu);
    state->status = s;
    state->done = true;
    state->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_for(lock, timeout, [&] { return state->done; })) return std::nullopt;
  return state->status;
}

abi::Info info_int(const char* key, int value) {
  abi::Info i;
  std::memset(&i, 0, sizeof i);
  std::strncpy(i.key, key, abi::kMaxKeyLen);
  i.value.type = abi::kInt;
  i.value.data.integer = value;
  return i;
}

abi::Info info_bool(const char* key, bool value) {
  abi::Info i;
  std::memset(&i, 0, sizeof i);
  std::strncpy(i.key, key, abi::kMaxKeyLen);
  i.value.type = abi::kBool;
  i.value.data.flag = value;
  return i;
}

// A value PMIx_Get returned (malloc'ed by libpmix, as its PMIX_VALUE_RELEASE frees it).
struct OwnedValue {
  abi::Value* v = nullptr;
  ~OwnedValue() {
    if (!v) return;
    if (v->type == abi::kString) std::free(v->data.string);
    std::free(v);
  }
};

// " at PMIX_SERVER_URI4=<uri>": the server address the newest protocol libpmix speaks reads (for messages).
std::string server_uri() {
  for (const char* name : {"PMIX_SERVER_URI4", "PMIX_SERVER_URI41", "PMIX_SERVER_URI3", "PMIX_SERVER_URI21",
                           "PMIX_SERVER_URI2", "PMIX_SERVER_URI"}) {
    if (auto v = env::get_raw(name)) return fmt::format(" at {}={}", name, *v);
  }
  return " (no PMIX_SERVER_URI* variable names one)";
}

std::string hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

// The process's connection to its PMIx server.
class Session {
 public:
  Session(const abi::Api& api, std::string where) : api_(api), where_(std::move(where)), pid_(getpid()) {}

  // PMIx counts inits: this ends only our own (an MPI library's stays). PMIx_Finalize waits at most
  // 2 s for its server's answer. Not in a forked child (the connection is its parent's), and never
  // after a call that did not come back: that thread is still inside libpmix.
  void finalize() {
    if (open_ && !stuck_ && getpid() == pid_) api_.Finalize(nullptr, 0);
    open_ = false;
  }

  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  bool stuck() const { return stuck_; }

  // Every call below runs on a thread that may outlive this object (bounded): its lambda owns what
  // libpmix reads or writes, and reaches libpmix through the process-wide table, not through `this`.
  void init() {
    auto me = std::make_shared<abi::Proc>();
    const abi::Api* api = &api_;
    auto status = bounded([api, me] { return api->Init(me.get(), nullptr, 0); }, timeout_);
    if (!status) {
      stuck_ = true;
      throw TimeoutError(fmt::format("{}: no PMIx server answers{} within {} ms (PMIx_Init did not return): the "
                                     "server is frozen, or the PMIX_* variables name something else; start the "
                                     "job with mpirun or srun --mpi=pmix, or set MASTER_ADDR and MASTER_PORT",
                                     where_, server_uri(), timeout_.count()));
    }
    if (*status != abi::kSuccess) {
      throw ConfigError(fmt::format("{}: no PMIx server answers{} (PMIx_Init: {}): the PMIX_* variables name a "
                                    "server that is not there; start the job with mpirun or srun --mpi=pmix, or "
                                    "set MASTER_ADDR and MASTER_PORT",
                                    where_, server_uri(), error_string(*status)));
    }
    me_ = *me;
    open_ = true;
  }

  int rank() const { return static_cast<int>(me_.rank); }
  std::string nspace() const { return std::string(me_.nspace, strnlen(me_.nspace, sizeof me_.nspace)); }

  // A value of the job (rank wildcard) or of one rank; nullopt when PMIx has none (or of another type).
  std::optional<uint32_t> get_uint32(abi::Rank rank, const char* key) {
    OwnedValue v = get(rank, key);
    if (v.v && v.v->type == abi::kUint32) return v.v->data.uint32;
    return std::nullopt;
  }
  std::optional<std::string> get_string(abi::Rank rank, const char* key) {
    OwnedValue v = get(rank, key);
    if (v.v && v.v->type == abi::kString && v.v->data.string) return std::string(v.v->data.string);
    return std::nullopt;
  }

  void put_and_commit(const std::string& key, const std::string& value) {
    const abi::Api* api = &api_;
    auto owned = std::make_shared<std::pair<std::string, std::string>>(key, value);
    expect(bounded(
               [api, owned] {
                 abi::Value v{};
                 v.type = abi::kString;
                 v.data.string = owned->second.data();  // PMIx copies it
                 return api->Put(abi::kGlobal, owned->first.c_str(), &v);
               },
               timeout_),
           "PMIx_Put " + key);
    expect(bounded([api] { return api->Commit(); }, timeout_), "PMIx_Commit");
  }

  // A barrier of the whole job that also hands every rank what the others committed. PMIx's server
  // ends it at PMIX_TIMEOUT; our own wait allows a little more so that its answer says what happened.
  void fence() {
    const int seconds = std::max<int>(1, static_cast<int>((timeout_.count() + 999) / 1000));
    auto info = std::make_shared<std::vector<abi::Info>>(
        std::vector<abi::Info>{info_bool(abi::kCollectData, true), info_int(abi::kTimeoutKey, seconds)});
    const abi::Api* api = &api_;
    auto status = bounded([api, info] { return api->Fence(nullptr, 0, info->data(), info->size()); },
                          std::chrono::milliseconds(seconds * 1000 + 2000));
    if (!status) {
      stuck_ = true;
      throw TimeoutError(fmt::format("{}: the PMIx server did not end the fence that hands out rank 0's store "
                                     "address within {} s",
                                     where_, seconds + 2));
    }
    if (*status == abi::kErrTimeout) {
      throw TimeoutError(fmt::format("{}: PMIx fence that hands out rank 0's store address: not every rank of PMIx "
                                     "job {} reached it within {} s (COHORT_TIMEOUT); every rank must build its "
                                     "communicator (Communicator::from_env)",
                                     where_, nspace(), seconds));
    }
    if (*status != abi::kSuccess) {
      throw Error(fmt::format("{}: PMIx fence that hands out rank 0's store address failed: {}", where_,
                              error_string(*status)));
    }
  }

  const std::string& where() const { return where_; }
  // What the last get answered, "NOT_FOUND (-46)" (for messages).
  std::string last_get_status() const { return error_string(last_get_); }

 private:
  OwnedValue get(abi::Rank rank, const char* key) {
    abi::Proc proc{};
    std::memcpy(proc.nspace, me_.nspace, sizeof proc.nspace);
    proc.rank = rank;
    const int seconds = std::max<int>(1, static_cast<int>((timeout_.count() + 999) / 1000));
    struct Call {
      abi::Proc proc;
      std::string key;
      abi::Info info;
      abi::Value* value = nullptr;
    };
    auto call = std::make_shared<Call>(Call{proc, key, info_int(abi::kTimeoutKey, seconds)});
    const abi::Api* api = &api_;
    auto status = bounded([api, call] { return api->Get(&call->proc, call->key.c_str(), &call->info, 1, &call->value); },
                          timeout_ + std::chrono::seconds(2));
    if (!status) {
      stuck_ = true;
      throw TimeoutError(fmt::format("{}: the PMIx server did not answer PMIx_Get {} within {} ms", where_, key,
                                     timeout_.count() + 2000));
    }
    OwnedValue out;
    last_get_ = *status;
    if (*status == abi::kSuccess) out.v = call->value;
    return out;
  }

  void expect(std::optional<abi::Status> status, const std::string& what) {
    if (!status) {
      stuck_ = true;
      throw TimeoutError(fmt::format("{}: the PMIx server did not answer {} within {} ms", where_, what,
                                     timeout_.count()));
    }
    if (*status != abi::kSuccess) throw Error(fmt::format("{}: {} failed: {}", where_, what, error_string(*status)));
  }

  std::string error_string(abi::Status s) const {
    const char* text = api_.Error_string(s);
    return fmt::format("{} ({})", text ? text : "unknown error", s);
  }

  const abi::Api& api_;
  std::chrono::milliseconds timeout_{std::chrono::minutes(5)};
  std::string where_;
  pid_t pid_;
  abi::Proc me_{};
  bool open_ = false;
  bool stuck_ = false;
  abi::Status last_get_ = abi::kSuccess;
};

// Where the other ranks reach rank 0's store: the loopback address when the whole job is on this
// host (PMIx's local size is the job's size); else COHORT_TCP_ADDR; else this host's address on the
// route to the host of the first rank that is not here (the interface the kernel would use to reach it).
std::string store_host(Session& s, int world) {
  auto local = s.get_uint32(abi::kRankWildcard, abi::kLocalSize);
  if (local && static_cast<int>(*local) == world) return "127.0.0.1";
  if (std::string a = kTcpAddr.get(); !a.empty()) return a;
  std::set<int> here;
  if (auto peers = s.get_string(abi::kRankWildcard, abi::kLocalPeers)) {
    for (const auto& r : str::split(*peers, ',')) here.insert(std::atoi(r.c_str()));
  }
  std::string why = "PMIx names no other host";
  for (int r = 1; r < world; ++r) {
    if (here.count(r)) continue;
    auto host = s.get_string(static_cast<abi::Rank>(r), abi::kHostname);
    if (!host) {
      why = fmt::format("PMIx gives no host name for rank {}", r);
      break;
    }
    try {
      return net::route_address_to(*host);
    } catch (const Error& e) {
      why = fmt::format("rank {}'s host {}: {}", r, *host, e.what());
    }
    break;
  }
  throw ConfigError(fmt::format("{}: the job spans hosts, and the address they reach this host's store at is "
                                "unknown ({}): set COHORT_TCP_ADDR to it",
                                s.where(), why));
}

// Opened by the first exchange and kept until the process exits: Open MPI's MPI_Init after a
// PMIx_Finalize in the same process fails ("getting local rank failed"), so a program that builds its
// communicator before MPI_Init needs the connection to last. Never freed: the exit handler uses it.
std::mutex session_mutex;
Session* session = nullptr;
std::string session_broken;  // why no session can be had (a PMIx call never returned)

void finalize_at_exit() {
  // A thread still in an exchange holds the lock (and waits on PMIx): leave PMIx alone then.
  std::unique_lock<std::mutex> g(session_mutex, std::try_to_lock);
  if (g.owns_lock() && session) session->finalize();
}

}  // namespace

const abi::Api* load(std::string* why_not) {
  static const Loaded loaded = load_once();
  if (!loaded.ok) {
    if (why_not) *why_not = loaded.why_not;
    return nullptr;
  }
  return &loaded.api;
}

void exchange_store_address(LaunchEnv& e, std::chrono::milliseconds timeout,
                            const std::function<uint16_t()>& start_store) {
  const std::string where = fmt::format("rank {} ({})", e.rank, net::hostname());
  std::lock_guard<std::mutex> g(session_mutex);
  if (!session_broken.empty()) throw Error(fmt::format("{}: PMIx is unusable in this process: {}", where, session_broken));
  if (!session) {
    std::string why;
    const abi::Api* api = load(&why);
    if (!api) {
      throw ConfigError(fmt::format("{}: MASTER_ADDR is not set and a PMIx server is named (PMIX_NAMESPACE, "
                                    "PMIX_RANK), but libpmix cannot be loaded: {}; install libpmix2 (or set "
                                    "COHORT_PMIX_LIBRARY), or set MASTER_ADDR and MASTER_PORT",
                                    where, why));
    }
    auto s = std::make_unique<Session>(*api, where);
    s->set_timeout(timeout);
    try {
      s->init();
    } catch (const Error& err) {
      if (s->stuck()) session_broken = err.what();
      throw;
    }
    session = s.release();
    std::atexit(finalize_at_exit);
  }
  Session& s = *session;
  s.set_timeout(timeout);
  // A call that never returns leaves the session unusable: later exchanges fail at once instead of
  // calling into libpmix beside the blocked thread.
  struct MarkIfStuck {
    Session& s;
    ~MarkIfStuck() {
      if (s.stuck() && session_broken.empty()) session_broken = "an earlier PMIx call never returned";
    }
  } mark{s};

  auto size = s.get_uint32(abi::kRankWildcard, abi::kJobSize);
  if (!size) {
    throw ConfigError(fmt::format("{}: the PMIx server gives no job size (PMIx_Get PMIX_JOB_SIZE: {})", where,
                                  s.last_get_status()));
  }
  if (s.rank() != e.rank || (e.world_size != 0 && static_cast<int>(*size) != e.world_size)) {
    throw ConfigError(fmt::format("{}: contradictory rank variables: PMIx says rank {} of {} (job {}) but {}", where,
                                  s.rank(), *size, s.nspace(), e.rank_vars));
  }
  e.world_size = static_cast<int>(*size);
  if (e.rank >= e.world_size) {
    throw ConfigError(fmt::format("{}: PMIx says rank {} of {}: out of range", where, e.rank, e.world_size));
  }

  // Each Communicator::from_env of a process meets afresh (every rank makes the same calls in the same
  // order), so a second one never reads the first one's address.
  static int exchanges = 0;
  const std::string key = fmt::format("cohort.store.{}", ++exchanges);  // PMIx does not spread keys "pmix*"
  std::string published;
  if (e.rank == 0) {
    // Without a token of the user's, rank 0 makes one: it travels only through PMIx, to this job's ranks.
    if (e.token.empty()) e.token = hex(store_auth::make_nonce());
    const uint16_t port = start_store();
    const std::string host = store_host(s, e.world_size);
    const std::string addr = host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                                                 : fmt::format("{}:{}", host, port);
    published = addr + " " + e.token;
    s.put_and_commit(key, published);
  }
  s.fence();
  if (e.rank != 0) {
    auto value = s.get_string(0, key.c_str());
    if (!value) {
      throw Error(fmt::format("{}: no store address from rank 0 of PMIx job {} (PMIx_Get {} after the fence: {})",
                              where, s.nspace(), key, s.last_get_status()));
    }
    published = *value;
  }
  const size_t space = published.find(' ');
  if (space == std::string::npos) throw Error(fmt::format("{}: malformed store address '{}' from PMIx", where, published));
  auto [host, port] = net::split_host_port(published.substr(0, space));
  e.store_host = host;
  e.store_port = port;
  e.token = published.substr(space + 1);
  log::info("the job's store is at {} (rank 0's, through PMIx job {}, {} ranks)", published.substr(0, space),
            s.nspace(), e.world_size);
}

}  // namespace cohort::comm::pmix
