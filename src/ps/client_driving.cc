// The worker side's requests in flight (client_impl.h): posting a request to a server, progressing
// an operation's calls until every reply is in, and turning what went wrong into one error: a
// timeout naming the servers that did not answer, a lost server, a refusal, a malformed reply.
// Every function here runs with the client's mutex held.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "ps/client_impl.h"
#include "ps/config_json.h"
#include "ps/decode.h"

namespace cohort::ps::client_internal {

std::string ClientImpl::reply_text(const Call& c) const {
  return std::string(reinterpret_cast<const char*>(c.reply_payload.data()), c.reply_payload.size());
}

Error ClientImpl::malformed(const Call& c, const std::string& why) const {
  return Error(fmt::format("parameter-server worker {}: server {} ({}) sent a malformed reply to {}: {}", worker_,
                           c.server, ep_->host_of(roles_.server_rank(c.server)), op_name(c.hdr.op), why));
}

void ClientImpl::run_locked(Operation& op) {
  auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (!progress_locked(op)) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::vector<std::string> who;
      for (auto& c : op.calls)
        if (!c->done) who.push_back(fmt::format("server {} ({})", c->server, ep_->host_of(roles_.server_rank(c->server))));
      throw TimeoutError(fmt::format("parameter-server worker {}: {} got no answer from {} within {:.0f} s "
                                     "(COHORT_TIMEOUT){}",
                                     worker_, op.what, fmt::join(who, ", "),
                                     std::chrono::duration<double>(timeout_).count(),
                                     mode_.mode == Mode::kAsync ? "" : "; in bsp/stale mode a pull waits for the slowest worker's step()"));
    }
    ep_->poll(10);
  }
  reap_background_locked();
  if (op.error) std::rethrow_exception(op.error);
}

// True when `op` is complete.
bool ClientImpl::progress_locked(Operation& op) {
  if (op.done) return true;
  try {
    bool all = true;
    for (auto& c : op.calls) {
      try {
        all &= progress_call(*c);
      } catch (const InvalidArgument&) {
        throw;
      } catch (const Error& e) {
        throw_lost(op.what, e);
      }
    }
    if (!all) return false;
    for (auto& c : op.calls)
      if (c->reply.status != Status::kOk) throw InvalidArgument(reply_message(c->reply));
    if (op.finish) op.finish(op);
  } catch (const InvalidArgument&) {
    op.error = std::current_exception();
  }
  op.done = true;
  // Every byte has been sent and read: the buffers serve the next calls. (Replies that callers
  // read after completion — hello, describe, save, stats — are read before the next call.)
  if (op.recycle) {
    for (auto& c : op.calls) {
      pool_.give(std::move(c->payload));
      pool_.give(std::move(c->reply_payload));
    }
  }
  return true;
}

// The connections failed (a server lost, or a failure notice): the transport's message names the
// peer that caused it, whichever server this call was waiting for.
[[noreturn]] void ClientImpl::throw_lost(const std::string& what, const Error& e) {
  broken_ = true;
  throw PeerLostError(fmt::format("parameter-server worker {}: {} failed: {}", worker_, what,
                                  name_roles(e.what(), roles_.num_servers)));
}

bool ClientImpl::progress_call(Call& c) {
  if (c.done) return true;
  ep_->test(c.hdr_send);
  if (c.payload_send) ep_->test(c.payload_send);
  if (!c.have_reply) {
    if (!ep_->test(c.reply_recv)) return false;
    // Checked before its payload is allocated (decode.h): a payload of the size this request gets.
    if (std::string why = check_reply_header(c.hdr, c.reply); !why.empty())
      throw Error(fmt::format("server {} sent a malformed {}", c.server, why));
    c.have_reply = true;
    if (c.reply.payload > 0) {
      c.reply_payload = pool_.take(c.reply.payload);
      c.reply_payload_recv = ep_->irecv(roles_.server_rank(c.server), Msg::kReplyPayload, c.seq,
                                       c.reply_payload.data(), c.reply_payload.size());
    }
  }
  if (c.reply_payload_recv && !ep_->test(c.reply_payload_recv)) return false;
  // A reply implies the server read our request; our sends completed (tcp/shm report send
  // completion when the bytes left our buffer).
  if (!ep_->test(c.hdr_send) || (c.payload_send && !ep_->test(c.payload_send))) return false;
  c.done = true;
  return true;
}

// Every started operation stays here until complete, so that its buffers outlive the transport's
// use of them even when the caller drops its handle.
void ClientImpl::reap_background_locked() {
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (!progress_locked(**it)) {
      ++it;
      continue;
    }
    auto op = *it;
    it = inflight_.erase(it);
    if (op->background && op->error) std::rethrow_exception(op->error);
  }
}

Call& ClientImpl::post(Operation& op, int server, Op kind, const std::string& table, Buffer payload,
                       const std::function<void(RequestHeader&)>& fill) {
  auto c = std::make_unique<Call>();
  if (!table.empty()) set_table_name(c->hdr, table);  // may throw: before the request is numbered
  c->server = server;
  c->seq = next_seq_[size_t(server)]++;
  c->hdr.op = kind;
  c->hdr.clock = clock_;
  c->payload = std::move(payload);
  c->hdr.payload = c->payload.size();
  if (fill) fill(c->hdr);
  const int peer = roles_.server_rank(server);
  try {
    c->hdr_send = ep_->isend(peer, Msg::kRequest, c->seq, &c->hdr, sizeof c->hdr);
    if (!c->payload.empty())
      c->payload_send = ep_->isend(peer, Msg::kRequestPayload, c->seq, c->payload.data(), c->payload.size());
    c->reply_recv = ep_->irecv(peer, Msg::kReply, c->seq, &c->reply, sizeof c->reply);
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    throw_lost(fmt::format("{} of '{}'", op_name(kind), table), e);
  }
  op.calls.push_back(std::move(c));
  return *op.calls.back();
}

std::shared_ptr<Operation> ClientImpl::start_all(Op kind, const std::string& table,
                                                 const std::string& payload, std::string what) {
  auto op = std::make_shared<Operation>();
  op->what = std::move(what);
  for (int s = 0; s < roles_.num_servers; ++s) post(*op, s, kind, table, buffer_of(payload));
  inflight_.push_back(op);
  return op;
}

TableConfig ClientImpl::table_locked(const std::string& name) {
  auto it = tables_.find(name);
  if (it != tables_.end()) return it->second;
  auto op = std::make_shared<Operation>();
  op->what = fmt::format("describe '{}'", name);
  post(*op, 0, Op::kDescribe, name, {});
  inflight_.push_back(op);
  run_locked(*op);
  TableConfig c;
  nlohmann::json j;
  std::string why = parse_json(reply_text(*op->calls.front()), &j);
  if (why.empty()) why = parse_config(j, name, &c);
  if (!why.empty()) throw malformed(*op->calls.front(), why);
  tables_[name] = c;
  return c;
}

}  // namespace cohort::ps::client_internal
