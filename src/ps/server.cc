// The parameter server: one thread, one loop over the PS world's connections (server_impl.h lists
// the files behind it; this one is where a reader starts).
//
// The loop keeps one posted header receive per worker (the worker's next request number), reads
// the payload the header announces, handles the request and posts its reply; replies in flight
// are kept until their sends complete. Nothing here blocks except Endpoint::poll, bounded to 100 ms
// so that slow-warnings come on time. A lost worker fails the transport: serve() throws, the
// process exits non-zero and the launcher ends the job naming it.
//
// Consistency (bsp, stale:K: a pull or save answered later, a push held) is server_consistency.cc's.
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "common/log.h"
#include "ps/config_json.h"
#include "ps/decode.h"
#include "ps/server.h"
#include "ps/server_impl.h"
#include "ps/wire.h"

namespace cohort::ps {

namespace server_internal {

namespace {

// A server connects to the workers only.
std::vector<bool> workers_only(const Roles& roles) {
  std::vector<bool> peers(size_t(roles.size()), false);
  for (int w = 0; w < roles.num_workers; ++w) peers[size_t(roles.worker_rank(w))] = true;
  return peers;
}

}  // namespace

Server::Server(std::shared_ptr<Store> store, const std::string& prefix, int index, const Roles& roles,
               ConsistencyMode mode, std::chrono::milliseconds timeout, uint64_t max_request)
    : roles_(roles),
      index_(index),
      mode_(mode),
      max_request_(max_request),
      timeout_(timeout),
      ep_(std::move(store), prefix, roles.server_rank(index), workers_only(roles), timeout, max_request) {
  inbox_.resize(size_t(roles_.num_workers));
  clock_.assign(size_t(roles_.num_workers), 0);
  log::debug("parameter server {} of {}: {} workers, mode {}", index_, roles_.num_servers, roles_.num_workers,
             mode_.to_string());
}

// A save a worker staged and never ended (it was lost in between) leaves no files.
Server::~Server() {
  for (auto& [w, st] : staged_) remove_files(st);
}

void Server::run() {
  for (int w = 0; w < roles_.num_workers; ++w) post_header(w);
  int open = roles_.num_workers;
  while (open > 0 || !sending_.empty()) {
    ep_.poll(100);
    for (int w = 0; w < roles_.num_workers; ++w) {
      Inbox& in = inbox_[size_t(w)];
      if (in.bye) continue;
      // Several requests of one worker may be waiting: take them all.
      for (;;) {
        if (!in.reading_payload) {
          if (!ep_.test(in.hdr_recv)) break;
          in.payload.resize(0);
          if (std::string why = check_request_frame(in.hdr, max_request_); !why.empty()) {
            // A header that is not ours, or a payload over the limit (the client refuses those
            // against the limit this server announced): refused. Its payload, whose size is not
            // to be trusted or allocated, is never received: whatever the worker sends under this
            // number is thrown away as it comes (one over the limit was never buffered: the
            // transports keep nothing over max_request that no receive asked for). Requests are
            // matched by number, so the worker's next one is read as usual.
            ep_.discard(roles_.worker_rank(w), Msg::kRequestPayload, in.seq);
            reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, why));
            ++in.seq;
            post_header(w);
            continue;
          }
          if (in.hdr.payload > 0) {
            in.payload.resize(in.hdr.payload);
            in.payload_recv = ep_.irecv(roles_.worker_rank(w), Msg::kRequestPayload, in.seq, in.payload.data(),
                                        in.payload.size());
            in.reading_payload = true;
          }
        }
        if (in.reading_payload && !ep_.test(in.payload_recv)) break;
        in.reading_payload = false;
        handle(w);
        if (in.bye) {
          --open;
          break;
        }
        ++in.seq;
        post_header(w);
      }
    }
    // Sent replies give their buffers back. Sends complete in order per peer; a long reply to one
    // worker must not keep the others' buffers: past a few, any completed one goes.
    while (!sending_.empty() && sent(*sending_.front())) {
      pool_.give(std::move(sending_.front()->payload));
      sending_.pop_front();
    }
    if (sending_.size() > 64)
      std::erase_if(sending_, [this](const std::unique_ptr<Outgoing>& o) { return sent(*o); });
    warn_deferred();
  }
}

void Server::post_header(int w) {
  Inbox& in = inbox_[size_t(w)];
  in.hdr_recv = ep_.irecv(roles_.worker_rank(w), Msg::kRequest, in.seq, &in.hdr, sizeof in.hdr);
}

void Server::reply(int w, uint64_t seq, Buffer payload) {
  auto o = std::make_unique<Outgoing>();
  o->worker = w;
  o->payload = std::move(payload);
  o->hdr.payload = o->payload.size();
  o->hdr_send = ep_.isend(roles_.worker_rank(w), Msg::kReply, seq, &o->hdr, sizeof o->hdr);
  if (!o->payload.empty())
    o->payload_send = ep_.isend(roles_.worker_rank(w), Msg::kReplyPayload, seq, o->payload.data(), o->payload.size());
  sending_.push_back(std::move(o));
}

void Server::reply_error(int w, uint64_t seq, const std::string& message) {
  auto o = std::make_unique<Outgoing>();
  o->worker = w;
  o->hdr.status = Status::kInvalid;
  std::snprintf(o->hdr.message, sizeof o->hdr.message, "%s", message.c_str());
  o->hdr_send = ep_.isend(roles_.worker_rank(w), Msg::kReply, seq, &o->hdr, sizeof o->hdr);
  sending_.push_back(std::move(o));
}

void Server::handle(int w) {
  Inbox& in = inbox_[size_t(w)];
  Request r;
  // Every count, length and name is checked before it is used (decode.h); a malformed request is
  // refused like any other mistake of the worker's.
  if (std::string why = decode_request(in.hdr, in.payload.data(), in.payload.size(), max_request_, &r); !why.empty())
    return reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, why));
  try {
    switch (r.op) {
      case Op::kHello: {
        nlohmann::json j{{"mode", mode_.to_string()}, {"max_request", max_request_}};
        return reply(w, in.seq, buffer_of(j.dump()));
      }
      case Op::kCreate: return create(w, in.seq, r);
      case Op::kDescribe: {
        TableShard& t = table(r, false);
        return reply(w, in.seq, buffer_of(config_to_json(t.config()).dump()));
      }
      case Op::kPull: {
        TableShard& t = table(r, true);
        check_ids(t, r.ids, r.n);
        return pull_or_defer(w, in.seq, t, r.clock, r.ids, r.n);
      }
      case Op::kPush:
      case Op::kPushPull: {
        TableShard& t = table(r, true);
        check_ids(t, r.ids, r.n);
        // The pull ids follow dim * n floats: not 8-byte aligned for an odd dim, so copied out.
        std::vector<uint64_t> pull_ids(r.m);
        if (r.m > 0) std::memcpy(pull_ids.data(), r.pull_ids, r.m * 8);
        check_ids(t, pull_ids.data(), r.m);
        push(w, t, r.clock, r.ids, r.n, r.grads);
        if (r.op == Op::kPush) return reply(w, in.seq);
        advance_clock(w, r.clock + 1);
        return pull_or_defer(w, in.seq, t, r.clock + 1, pull_ids.data(), r.m);
      }
      case Op::kClock:
        reply(w, in.seq);
        return advance_clock(w, r.clock);
      case Op::kSave: {
        // bsp/stale: the files hold every push of the steps the saving worker has ended (held bsp
        // sums included), whatever order the workers' messages arrive in.
        const uint64_t seq = in.seq;
        auto answer = [this, w, seq, dir = r.text] {
          try {
            reply(w, seq, buffer_of(stage_save(w, dir)));
          } catch (const InvalidArgument& e) {  // stage_save makes every error of a save one
            reply_error(w, seq, fmt::format("parameter server {}: {}", index_, e.what()));
          }
        };
        if (mode_.mode == Mode::kAsync || may_answer(r.clock, 0)) return answer();
        deferred_.push_back(Deferred{w, seq, r.clock, 0, fmt::format("save to {}", r.text), answer});
        return;
      }
      case Op::kLoad:
        stage_load(w, r.text);
        return reply(w, in.seq);
      case Op::kCommit:
        commit(w);
        return reply(w, in.seq);
      case Op::kDiscard:
        discard(w);
        return reply(w, in.seq);
      case Op::kStats: {
        TableShard& t = table(r, false);
        uint64_t s[4] = {t.rows(), t.bytes(), t.applied(), t.direct_applied()};
        static_assert(sizeof s == kStatsReplyBytes);
        Buffer out;
        out.resize(sizeof s);
        std::memcpy(out.data(), s, sizeof s);
        return reply(w, in.seq, std::move(out));
      }
      case Op::kAttach: return attach(w, in.seq, r);
      case Op::kBye:
        in.bye = true;
        reply(w, in.seq);
        return advance_clock(w, kDone);
    }
  } catch (const InvalidArgument& e) {
    // The worker's mistake: it gets the reason; everyone else is served on.
    reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, e.what()));
  }
}

}  // namespace server_internal

void run_server(std::shared_ptr<Store> store, const std::string& prefix, int index, const Roles& roles,
                ConsistencyMode mode, std::chrono::milliseconds timeout, uint64_t max_request) {
  try {
    server_internal::Server(std::move(store), prefix, index, roles, mode, timeout, max_request).run();
  } catch (const PeerLostError& e) {
    throw PeerLostError(fmt::format("parameter server {}: {}", index, name_roles(e.what(), roles.num_servers)));
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("parameter server {}: {}", index, name_roles(e.what(), roles.num_servers)));
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    throw Error(fmt::format("parameter server {}: {}", index, name_roles(e.what(), roles.num_servers)));
  }
}

}  // namespace cohort::ps
