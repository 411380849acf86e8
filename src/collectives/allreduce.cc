// allreduce and reduce_scatter entry points, recursive doubling and recursive halving-doubling.
//
// Non-powers of two (both rd and rhd): with p' the largest power of two <= p and e = p - p', the
// first 2e ranks pair up (2i, 2i+1): the even rank sends its vector to the odd one, which combines
// them (even's operand first) and takes part in the power-of-two algorithm as rank i; the other
// ranks r >= 2e take part as rank r - e. At the end each odd rank sends the result back.
#include <cstring>

#include "collectives/collectives.h"
#include "collectives/detail.h"
#include "collectives/reduce_kernels.h"
#include "collectives/select.h"

namespace cohort::coll {

void ring_allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op);

namespace {

using detail::bytes_at;
using detail::Layout;

// The power-of-two group after folding.
struct Fold {
  int pow2 = 1;
  int extra = 0;
  int newrank = -1;  // -1: this rank sat out (even rank of a folded pair)
  int real(int nr) const { return nr < extra ? 2 * nr + 1 : nr + extra; }
};

Fold make_fold(int rank, int p) {
  Fold f;
  f.pow2 = detail::pow2_floor(p);
  f.extra = p - f.pow2;
  if (rank < 2 * f.extra) f.newrank = (rank % 2 == 1) ? rank / 2 : -1;
  else f.newrank = rank - f.extra;
  return f;
}

// Fold step. Returns the pointer holding this rank's (possibly combined) input afterwards: `send`
// when nothing was combined, else `recv`.
const void* fold_in(Context& ctx, const Fold& f, const void* send, void* recv, void* tmp, size_t count,
                    DataType dtype, ReduceOp op) {
  const int r = ctx.rank();
  const size_t bytes = count * dtype_size(dtype);
  if (r >= 2 * f.extra) return send;
  if (f.newrank < 0) {
    ctx.wait(ctx.isend(r + 1, send, bytes));
    return send;
  }
  ctx.wait(ctx.irecv(r - 1, tmp, bytes));
  kernels::reduce_to(recv, tmp, send, count, dtype, op);  // lower rank's operand first
  return recv;
}

void fold_out(Context& ctx, const Fold& f, void* recv, size_t bytes) {
  const int r = ctx.rank();
  if (r >= 2 * f.extra) return;
  if (f.newrank < 0) ctx.wait(ctx.irecv(r + 1, recv, bytes));
  else ctx.wait(ctx.isend(r - 1, recv, bytes));
}

// Combines `theirs` into `mine` (result in `out`) with the lower-numbered side's operand first, so
// both partners compute bit-identical results.
void combine_ordered(void* out, const void* mine, const void* theirs, bool mine_is_lower, size_t n, DataType dtype,
                     ReduceOp op) {
  if (mine_is_lower) kernels::reduce_to(out, mine, theirs, n, dtype, op);
  else kernels::reduce_to(out, theirs, mine, n, dtype, op);
}

void rd_allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  const Fold f = make_fold(ctx.rank(), ctx.size());
  void* tmp = ctx.scratch(bytes, 1);
  const void* src = fold_in(ctx, f, send, recv, tmp, count, dtype, op);
  if (f.newrank >= 0) {
    for (int mask = 1; mask < f.pow2; mask <<= 1) {
      const int partner_new = f.newrank ^ mask;
      const int partner = f.real(partner_new);
      detail::sendrecv(ctx, partner, src, bytes, partner, tmp, bytes);
      combine_ordered(recv, src, tmp, f.newrank < partner_new, count, dtype, op);
      src = recv;
    }
    if (src != recv) std::memcpy(recv, src, bytes);  // pow2 == 1 cannot happen for p >= 2
  }
  fold_out(ctx, f, recv, bytes);
}

void rhd_allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  const size_t esize = dtype_size(dtype);
  const size_t bytes = count * esize;
  const Fold f = make_fold(ctx.rank(), ctx.size());
  void* tmp = ctx.scratch(bytes, 1);
  const void* src = fold_in(ctx, f, send, recv, tmp, count, dtype, op);
  if (f.newrank >= 0) {
    const Layout layout = Layout::even(count, f.pow2);
    const int me = f.newrank;
    // Recursive halving: keep the half of the current window that holds block `me`.
    int lo = 0;
    for (int mask = f.pow2 / 2; mask >= 1; mask >>= 1) {
      const int partner_new = me ^ mask;
      const int partner = f.real(partner_new);
      const bool lower = (me & mask) == 0;
      const int keep = lower ? lo : lo + mask;
      const int give = lower ? lo + mask : lo;
      const size_t keep_off = layout.offset(keep) * esize, keep_n = layout.span_count(keep, mask);
      const size_t give_off = layout.offset(give) * esize, give_n = layout.span_count(give, mask);
      detail::sendrecv(ctx, partner, bytes_at(src, give_off), give_n * esize, partner, tmp, keep_n * esize);
      combine_ordered(bytes_at(recv, keep_off), bytes_at(src, keep_off), tmp, lower, keep_n, dtype, op);
      lo = keep;
      // Regions outside the kept window are never read again; the window now lives in recv.
      src = recv;
    }
    // Recursive doubling allgather of the reduced blocks, straight into recv.
    for (int mask = 1; mask < f.pow2; mask <<= 1) {
      const int partner_new = me ^ mask;
      const int partner = f.real(partner_new);
      const int mine = me & ~(mask - 1), theirs = partner_new & ~(mask - 1);
      detail::sendrecv(ctx, partner, bytes_at(recv, layout.offset(mine) * esize), layout.span_count(mine, mask) * esize,
                       partner, bytes_at(recv, layout.offset(theirs) * esize),
                       layout.span_count(theirs, mask) * esize);
    }
  }
  fold_out(ctx, f, recv, bytes);
}

}  // namespace

void allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
               Algorithm algo) {
  const int p = ctx.size();
  const size_t bytes = count * dtype_size(dtype);
  if (count == 0) return;
  if (p == 1) {
    if (send != recv) std::memcpy(recv, send, bytes);
    return;
  }
  switch (select_algorithm(OpKind::kAllreduce, p, bytes, algo)) {
    case Algorithm::kRecursiveDoubling: rd_allreduce(ctx, send, recv, count, dtype, op); break;
    case Algorithm::kHalvingDoubling: rhd_allreduce(ctx, send, recv, count, dtype, op); break;
    default: ring_allreduce(ctx, send, recv, count, dtype, op); break;
  }
  if (op == ReduceOp::kAvg) kernels::finish_average(recv, count, dtype, p);
}

void reduce_scatter(Context& ctx, const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op,
                    Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t esize = dtype_size(dtype);
  const size_t block_bytes = recv_count * esize;
  if (recv_count == 0) return;
  select_algorithm(OpKind::kReduceScatter, p, block_bytes * static_cast<size_t>(p), algo);  // validates
  const bool in_place = send == recv;
  if (p == 1) {
    if (!in_place) std::memcpy(recv, send, block_bytes);
  } else {
    const Layout layout = Layout::fixed(recv_count, p);
    void* work = ctx.scratch(block_bytes * static_cast<size_t>(p), 1);
    // In place, the input's first block is overwritten by the result, so the result is staged in work.
    detail::ring_engine(ctx, send, work, in_place ? nullptr : recv, layout, esize, dtype, op, true, false);
    if (in_place) std::memcpy(recv, bytes_at(work, static_cast<size_t>(r) * block_bytes), block_bytes);
  }
  if (op == ReduceOp::kAvg) kernels::finish_average(recv, recv_count, dtype, p);
}

}  // namespace cohort::coll
