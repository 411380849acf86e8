// What a hostile or broken peer sends: a worker that speaks the wire protocol itself sends requests
// no client would (counts whose byte sizes overflow, truncated payloads, bad names, unknown types,
// foreign headers); a server that speaks it itself sends replies of the wrong size. The server
// refuses each request with a message naming what was wrong and serves on; the worker refuses each
// reply without reading past it.
#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <stdexcept>
#include <thread>

#include "cohort/error.h"
#include "ps/wire.h"
#include "ps_test_util.h"
#include "transport/matching.h"

namespace cohort::ps {
namespace {

using test_util::kTimeout;
using test_util::ScopedEnv;

// One end of the PS world that sends and reads the messages of src/ps/wire.h as given.
class RawPeer {
 public:
  RawPeer(std::shared_ptr<Store> store, int rank, const Roles& roles, bool server)
      : ep_(std::move(store), "ps", rank, peers(roles, server), kTimeout) {}

  struct Reply {
    ReplyHeader hdr;
    std::vector<uint8_t> payload;
    std::string message() const { return std::string(hdr.message, strnlen(hdr.message, sizeof hdr.message)); }
  };

  // A worker's request to server `s` under its next number: the header as it is (whatever its payload
  // field says), then `payload` as a message of its own when not empty; returns the reply.
  Reply call(int s, const RequestHeader& h, const std::vector<uint8_t>& payload = {}) {
    const uint64_t seq = next_[s]++;
    Posted hs = ep_.isend(s, Msg::kRequest, seq, &h, sizeof h);
    Posted ps;
    if (!payload.empty()) ps = ep_.isend(s, Msg::kRequestPayload, seq, payload.data(), payload.size());
    Reply r;
    Posted rr = ep_.irecv(s, Msg::kReply, seq, &r.hdr, sizeof r.hdr);
    wait(rr, "the reply's header");
    if (r.hdr.payload > 0) {
      if (r.hdr.payload > (64u << 20)) throw std::runtime_error("a reply payload over 64 MiB");
      r.payload.resize(r.hdr.payload);
      Posted rp = ep_.irecv(s, Msg::kReplyPayload, seq, r.payload.data(), r.payload.size());
      wait(rp, "the reply's payload");
    }
    wait(hs, "the request's send");
    if (ps) wait(ps, "the payload's send");
    return r;
  }

  // A server's side: the next request of worker rank `w` (header and payload).
  RequestHeader next_request(int w, std::vector<uint8_t>* payload) {
    RequestHeader h;
    Posted p = ep_.irecv(w, Msg::kRequest, next_[w], &h, sizeof h);
    wait(p, "a request");
    payload->assign(h.payload, 0);
    if (h.payload > 0) {
      Posted q = ep_.irecv(w, Msg::kRequestPayload, next_[w], payload->data(), payload->size());
      wait(q, "a request's payload");
    }
    return h;
  }
  // ... and its reply, as given.
  void answer(int w, ReplyHeader hdr, const std::string& payload) {
    const uint64_t seq = next_[w]++;
    Posted a = ep_.isend(w, Msg::kReply, seq, &hdr, sizeof hdr);
    Posted b;
    if (!payload.empty()) b = ep_.isend(w, Msg::kReplyPayload, seq, payload.data(), payload.size());
    wait(a, "the reply's send");
    if (b) wait(b, "the reply payload's send");
  }

 private:
  static std::vector<bool> peers(const Roles& roles, bool server) {
    std::vector<bool> p(size_t(roles.size()), false);
    if (server)
      for (int w = 0; w < roles.num_workers; ++w) p[size_t(roles.worker_rank(w))] = true;
    else
      for (int s = 0; s < roles.num_servers; ++s) p[size_t(roles.server_rank(s))] = true;
    return p;
  }

  void wait(Posted& p, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!ep_.test(p)) {
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error(std::string("no ") + what + " within 20 s: the peer stopped serving");
      ep_.poll(10);
    }
  }

  Endpoint ep_;
  std::map<int, uint64_t> next_;
};

RequestHeader header(Op op, const std::string& table, uint32_t dim = 0, uint64_t n = 0, uint64_t payload = 0) {
  RequestHeader h;
  h.op = op;
  std::memcpy(h.table, table.data(), std::min(table.size(), sizeof h.table - 1));  // any bytes, unchecked here
  h.dim = dim;
  h.n = n;
  h.payload = payload;
  return h;
}

std::vector<uint8_t> bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string config_json(const std::string& dim) {
  return R"({"dim":)" + dim + R"(,"dense":false,"rows":0,"storage":"float32","optimizer":"sgd","lr":1,"beta1":0.9,)"
         R"("beta2":0.999,"eps":1e-8,"initial_accumulator":0,"init":"zeros","init_a":0,"init_b":0,"seed":0})";
}

// Each malformed request gets an error reply naming what was wrong, and the server serves on: the
// sender's next requests and another worker's pulls are answered as before.
TEST(PsWire, MalformedRequestsGetAnErrorNamingWhatWasWrongAndTheServerServesOthers) {
  ScopedEnv limit("COHORT_PS_MAX_REQUEST", "65536");  // read at the server's start
  test::TempDir dir;
  auto store = make_memory_store();
  const Roles roles{1, 2};
  std::barrier sync(2);
  test::run_ranks(3, [&](int r) {
    if (r == 0) return serve(store, 0, roles, {}, kTimeout);
    if (r == 2) {  // worker 1: a client as every program has
      auto c = Client::create(store, 1, roles, kTimeout);
      TableConfig cfg;
      cfg.dim = 8;
      cfg.lr = 1.0f;
      c->create_table("emb", cfg);
      std::vector<uint64_t> ids = {1, 2};
      std::vector<float> g(16, 1.0f);
      c->push("emb", ids.data(), ids.size(), g.data());
      sync.arrive_and_wait();  // the table exists
      sync.arrive_and_wait();  // the raw worker is through
      EXPECT_EQ(test_util::pull_rows(*c, "emb", ids), std::vector<float>(16, -1.0f));
      return;
    }
    RawPeer raw(store, roles.worker_rank(0), roles, false);
    auto hello = raw.call(0, header(Op::kHello, ""));
    ASSERT_EQ(hello.hdr.status, Status::kOk) << hello.message();
    sync.arrive_and_wait();
    const std::vector<uint8_t> one_id(8, 0);
    struct Case {
      const char* what;
      RequestHeader h;
      std::vector<uint8_t> payload;
      std::vector<std::string> expect;  // in the error message
    };
    RequestHeader foreign = header(Op::kPull, "emb", 8, 1, 8);
    foreign.magic = 0xdeadbeef;
    RequestHeader unknown = header(Op::kPull, "emb", 8, 1, 8);
    unknown.op = static_cast<Op>(200);
    const std::string nul_path = dir.path() + "/a" + std::string(1, '\0') + "b";
    const uint64_t wraps = (uint64_t{1} << 61) + 1;  // * 8 and * (8 + 8 * 4) wrap around to 8 and 40
    std::vector<Case> cases = {
        {"ids whose bytes overflow 64 bits (n * 8 == 8 mod 2^64)", header(Op::kPull, "emb", 8, wraps, 8), one_id,
         {"pull of 'emb': payload of 8 bytes, expected more than 2^64 for 2305843009213693953 ids"}},
        {"a push whose ids and gradients overflow (n * 40 == 40 mod 2^64)", header(Op::kPush, "emb", 8, wraps, 40),
         std::vector<uint8_t>(40, 0), {"push of 'emb': payload of 40 bytes, expected more than 2^64", "of dim 8"}},
        {"a truncated payload", header(Op::kPull, "emb", 8, 3, 16), std::vector<uint8_t>(16, 0),
         {"pull of 'emb': payload of 16 bytes, expected 24 for 3 ids"}},
        {"a table name that leaves the save directory", header(Op::kPull, "../etc", 8, 1, 8), one_id,
         {"table name '../etc': expected 1 to 63 characters"}},
        {"a table name with a newline", header(Op::kCreate, "a\nb", 0, 0, config_json("8").size()),
         bytes(config_json("8")), {"table name 'a\\x0ab'"}},
        {"an unknown request type", unknown, one_id, {"unknown request type 200"}},
        {"a header that is not a cohort request", foreign, {}, {"malformed request: magic 0xdeadbeef"}},
        {"a payload far over the limit, never sent", header(Op::kPull, "emb", 8, 1, uint64_t{1} << 62), {},
         {"request of 4611686018427387904 bytes exceeds this server's limit of 65536 bytes"}},
        {"a reply over the limit", header(Op::kPull, "emb", 8, 4096, 4096 * 8), std::vector<uint8_t>(4096 * 8, 0),
         {"a reply of 4096 rows of dim 8 is 131072 bytes, more than this server's limit of 65536"}},
        {"a row width of 0", header(Op::kPull, "emb", 0, 1, 8), one_id, {"pull of 'emb': dim 0: expected 1 to"}},
        {"a configuration that is not JSON", header(Op::kCreate, "bad", 0, 0, 5), bytes("{dim:"),
         {"create_table of 'bad': configuration is not valid JSON"}},
        {"a negative dim", header(Op::kCreate, "bad", 0, 0, config_json("-1").size()), bytes(config_json("-1")),
         {"table 'bad': 'dim': expected an integer from 0 to 4294967295, got -1"}},
        {"a directory with a NUL byte", header(Op::kSave, "", 0, 0, nul_path.size()), bytes(nul_path),
         {"save: the directory path holds a NUL byte"}},
        {"a payload where none belongs", header(Op::kDescribe, "emb", 0, 0, 3), bytes("abc"),
         {"describe of 'emb': payload of 3 bytes, expected none"}},
    };
    for (auto& c : cases) {
      auto reply = raw.call(0, c.h, c.payload);
      EXPECT_EQ(reply.hdr.status, Status::kInvalid) << c.what;
      EXPECT_EQ(reply.hdr.payload, 0u) << c.what;
      const std::string m = reply.message();
      EXPECT_EQ(m.find('\n'), std::string::npos) << c.what << ": " << m;
      EXPECT_EQ(m.rfind("parameter server 0: ", 0), 0u) << c.what << ": " << m;
      for (auto& e : c.expect) EXPECT_NE(m.find(e), std::string::npos) << c.what << ": " << m;
      // The sender itself is still served.
      auto stats = raw.call(0, header(Op::kStats, "emb"));
      ASSERT_EQ(stats.hdr.status, Status::kOk) << "after " << c.what << ": " << stats.message();
      ASSERT_EQ(stats.payload.size(), 32u);
      uint64_t rows = 0;
      std::memcpy(&rows, stats.payload.data(), 8);
      EXPECT_EQ(rows, 2u) << "after " << c.what;
    }
    EXPECT_FALSE(std::filesystem::exists(dir.file("a"))) << "a save went to the path cut at its NUL";
    auto bye = raw.call(0, header(Op::kBye, ""));
    EXPECT_EQ(bye.hdr.status, Status::kOk) << bye.message();
    sync.arrive_and_wait();
  });
}

// A refused request's payload is not kept. One over the limit is thrown away as it arrives (the
// transport buffers nothing that large that no receive asked for), and one whose header claims more
// than the limit while it sends less is freed. Before, every such payload stayed buffered in the
// server's transport for good: each refused request cost the very bytes the limit refuses. The bytes
// held are the transports' own count (buffered_bytes_in_process: this process holds the server).
// The threads here meet over shared memory; the transports' conformance tests
// (TransportConformance.ADiscardedMessage..., .AMessageOverTheLimit...) run the same on TCP.
TEST(PsWire, ARefusedRequestsPayloadIsNotKeptByTheServer) {
  ScopedEnv limit("COHORT_PS_MAX_REQUEST", "1048576");  // read at the server's start
  auto store = make_memory_store();
  const Roles roles{1, 1};
  const uint64_t held_before = transport::buffered_bytes_in_process();
  test::run_ranks(2, [&](int r) {
    if (r == 0) return serve(store, 0, roles, {}, kTimeout);
    RawPeer raw(store, roles.worker_rank(0), roles, false);
    ASSERT_EQ(raw.call(0, header(Op::kHello, "")).hdr.status, Status::kOk);
    const std::vector<uint8_t> over(2 << 20, 0), some(4096, 0);
    for (int i = 0; i < 8; ++i) {
      auto sent = raw.call(0, header(Op::kPull, "emb", 8, over.size() / 8, over.size()), over);
      EXPECT_EQ(sent.hdr.status, Status::kInvalid);
      EXPECT_NE(sent.message().find("request of 2097152 bytes exceeds this server's limit of 1048576 bytes"),
                std::string::npos) << sent.message();
      auto claimed = raw.call(0, header(Op::kPull, "emb", 8, 1, uint64_t{1} << 62), some);
      EXPECT_EQ(claimed.hdr.status, Status::kInvalid) << claimed.message();
    }
    // Requests the server takes, sent after them: once the push is answered, every byte sent
    // before it has reached the server's transport (a ring is one stream; over TCP, its payload of
    // over 256 KiB would cross every connection).
    const std::string cfg = config_json("8");
    ASSERT_EQ(raw.call(0, header(Op::kCreate, "emb", 0, 0, cfg.size()), bytes(cfg)).hdr.status, Status::kOk);
    const uint64_t n = 8192;
    std::vector<uint8_t> push(n * 8 + n * 8 * 4, 0);
    for (uint64_t i = 0; i < n; ++i) std::memcpy(push.data() + i * 8, &i, 8);
    auto pushed = raw.call(0, header(Op::kPush, "emb", 8, n, push.size()), push);
    ASSERT_EQ(pushed.hdr.status, Status::kOk) << pushed.message();
    // (Read on this thread, written on the server's: waited for, not assumed to be visible at once.)
    for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
         transport::buffered_bytes_in_process() != held_before;
         std::this_thread::sleep_for(std::chrono::milliseconds(1))) {
      ASSERT_LT(std::chrono::steady_clock::now(), until)
          << transport::buffered_bytes_in_process() - held_before << " bytes of refused payloads are still held";
    }
    ASSERT_EQ(raw.call(0, header(Op::kBye, "")).hdr.status, Status::kOk);
  });
}

// A server that answers with a payload of another size than the request gets: the worker throws
// naming the server and what was wrong, and neither allocates what the header claims nor reads past
// what came.
TEST(PsWire, AReplyOfTheWrongSizeIsRefusedByTheWorker) {
  ScopedEnv messages("COHORT_PS_DIRECT", "0");  // every pull through the (raw) server
  struct Case {
    const char* what;
    std::function<void(Client&)> call;
    uint64_t claimed;         // the reply's payload field
    std::string sent;         // what follows it
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"rows of a pull, one short",
       [](Client& c) {
         std::vector<uint64_t> ids = {1, 2};
         std::vector<float> rows(16);
         c.pull("emb", ids.data(), ids.size(), rows.data());
       },
       60, std::string(60, '\0'), "sent a malformed reply to pull of 'emb': payload of 60 bytes, expected 64 for 2 rows of dim 8"},
      {"stats claiming 2^62 bytes", [](Client& c) { c.stats("emb"); }, uint64_t{1} << 62, "",
       "sent a malformed reply to stats of 'emb': payload of 4611686018427387904 bytes, expected 32"},
  };
  for (const Case& k : cases) {
    auto store = make_memory_store();
    const Roles roles{1, 1};
    std::barrier done(2);
    test::run_ranks(2, [&](int r) {
      if (r == 0) {
        RawPeer server(store, 0, roles, true);
        const int w = roles.worker_rank(0);
        std::vector<uint8_t> payload;
        for (;;) {
          RequestHeader h = server.next_request(w, &payload);
          ReplyHeader reply;
          if (h.op == Op::kHello) {
            std::string j = R"({"mode":"async","max_request":65536})";
            reply.payload = j.size();
            server.answer(w, reply, j);
          } else if (h.op == Op::kDescribe) {
            std::string j = config_json("8");
            reply.payload = j.size();
            server.answer(w, reply, j);
          } else {
            reply.payload = k.claimed;
            server.answer(w, reply, k.sent);
            break;
          }
        }
        done.arrive_and_wait();  // the worker has read the reply: this end may close
        return;
      }
      auto c = Client::create(store, 0, roles, kTimeout);
      try {
        k.call(*c);
        ADD_FAILURE() << k.what << ": accepted";
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("server 0 sent a malformed reply"), std::string::npos) << k.what << ": " << m;
        EXPECT_NE(m.find(k.expect), std::string::npos) << k.what << ": " << m;
      } catch (const std::exception& e) {
        ADD_FAILURE() << k.what << ": not a cohort error: " << e.what();
      }
      done.arrive_and_wait();
    });
  }
}

}  // namespace
}  // namespace cohort::ps
