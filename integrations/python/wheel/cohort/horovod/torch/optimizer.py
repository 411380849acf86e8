"""Horovod's DistributedOptimizer over cohort's collectives.

`hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())` returns an optimizer
of the same class as the one it wraps (so `isinstance(opt, torch.optim.SGD)` still holds) whose
gradients are averaged (or summed, ...) across the ranks before each step:

- During `loss.backward()`, a hook on each parameter fires when its gradient has been accumulated into
  `p.grad`, and starts that gradient's allreduce at once (`allreduce_async_`, in place). So the last
  layers' gradients travel while autograd still computes the first layers': communication overlaps
  backward, as with Horovod and torch DDP.
- `step()` (or `synchronize()`) waits for those allreduces, puts the results into `p.grad`, then runs
  the wrapped optimizer's step.
- `backward_passes_per_step=k`: the hooks let k backward passes accumulate into `p.grad` locally and
  start the allreduce on the k-th; like Horovod, the sum of the k passes is reduced (scale the loss by
  1/k for a mean).
- `groups`: the allreduces of a group's gradients start together, as one grouped allreduce, once the
  group's last gradient is ready.
- `op=hvd.Adasum`: the ranks' parameter changes, not their gradients, are combined
  (_DistributedAdasumOptimizer).

cohort's communicator pairs operations by their order, not by their names as Horovod's coordinator
does. So the allreduces start in one launch order, the same on every rank, whatever order the
gradients become ready in: a gradient ready early waits for those before it in that order (as torch
DDP's buckets do). The first step's order is the reverse of the parameters' (backward's usual order);
after it, every rank takes the order in which rank 0's gradients became ready. A gradient that a
rank's backward did not produce (a parameter its forward did not use, while another rank's did) is
reduced at `synchronize()` as zeros, in its place in the order: ranks whose graphs differ still pair
the right tensors.
"""
import os
import warnings
from contextlib import contextmanager

import torch

from .compression import Compression
from .functions import broadcast_object
from .mpi_ops import (Adasum, Average, allgather_async, allreduce_async_, global_process_set, grouped_allreduce_async_,
                      rank, size, synchronize)


def _split_evenly(items, parts):
    """`items` cut into `parts` consecutive runs whose lengths differ by at most one (no empty run)."""
    parts = min(parts, len(items))
    bounds = [len(items) * k // parts for k in range(parts + 1)]
    return [items[bounds[k]:bounds[k + 1]] for k in range(parts)]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Placed before the wrapped optimizer's class in the returned optimizer's bases: its step(),
    zero_grad() and load_state_dict() run first and hand on to the wrapped class's."""

    def _setup_distributed(self, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, sparse_as_dense, process_set):
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            named_parameters = [(f"allreduce.noname.{g}.{i}", p)
                                for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])]
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
            raise ValueError("DistributedOptimizer: named_parameters must be (name, parameter) pairs, "
                             "as model.named_parameters() yields")
        names = [name for name, _ in named_parameters]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"DistributedOptimizer: parameter names must be unique; repeated: {', '.join(duplicates)}")
        named_ids = {id(p) for _, p in named_parameters}
        unnamed = [p for p in all_params if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"DistributedOptimizer: {len(unnamed)} parameter(s) of the optimizer are missing "
                             f"from named_parameters (shapes {[tuple(p.shape) for p in unnamed]})")

        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._parameter_names = {p: name for name, p in named_parameters}
        # Parameters that get gradients, in one order on every rank: the optimizer's.
        self._trained = [p for p in all_params if p.requires_grad]
        self._passes_left = {p: backward_passes_per_step for p in self._trained}
        # A unit is what one allreduce covers: a parameter, or a tuple of them (a group).
        self._unit_of = {p: p for p in self._trained}
        self._units = list(self._trained)
        self._group_ready = {}
        self._handles = {}  # unit -> (handle, compression context), in the order they were started
        # The launch order (see the module's docstring): units start only in this order.
        self._launch_order = []
        self._next_launch = 0  # the index in _launch_order of the next unit to start
        self._ready = set()  # units whose gradients are ready this step
        self._ready_sequence = []  # ... in the order they became ready (rank 0's becomes the launch order)
        self._order_learned = False
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        self._groups = groups
        if not process_set.included():
            return
        if groups is not None:
            self._form_groups(groups)
        self._launch_order = list(reversed(self._units))
        if size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":
            for p in self._trained:
                self._hooks.append(self._register_gradient_hook(p))

    def _form_groups(self, groups):
        if isinstance(groups, list):
            seen = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("DistributedOptimizer: groups must be lists of the model's parameters")
                    if id(p) in seen:
                        raise ValueError(f"DistributedOptimizer: parameter {self._parameter_names.get(p)} is in two groups")
                    seen.add(id(p))
        elif not isinstance(groups, int) or groups <= 0:
            raise ValueError("DistributedOptimizer: groups must be a positive number of groups or a list of "
                             "lists of parameters")
        # The first rank's order of the parameters, so that every rank forms the same groups.
        root = self.process_set.ranks[0] if self.process_set.ranks else 0
        order = broadcast_object([self._parameter_names[p] for p in self._trained], root_rank=root,
                                 name="DistributedOptimizer.groups", process_set=self.process_set)
        ordered = self._by_names(order, {self._parameter_names[p]: p for p in self._trained}, root)
        if isinstance(groups, list):
            trained_ids = {id(p) for p in ordered}
            units = [tuple(p for p in group if id(p) in trained_ids) for group in groups]
            units = [u for u in units if u]
            grouped = {id(p) for u in units for p in u}
            units += [(p,) for p in ordered if id(p) not in grouped]
        else:
            units = [tuple(run) for run in _split_evenly(ordered, groups)]
        self._units = units
        self._unit_of = {p: unit for unit in units for p in unit}
        self._group_ready = {unit: 0 for unit in units}

    def _by_names(self, names, known, root):
        """The items `known` maps `names` (another rank's parameter names) to; a clear error when
        that rank's model has a parameter this one lacks."""
        missing = [name for name in names if name not in known]
        if missing:
            raise ValueError(f"DistributedOptimizer: rank {root}'s model has parameters rank {rank()}'s lacks: "
                             f"{', '.join(missing[:5])}; every rank must build the same model")
        return [known[name] for name in names]

    def _register_gradient_hook(self, p):
        """Calls _gradient_ready(p) each time backward has accumulated p's gradient into p.grad."""
        if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
            return p.register_post_accumulate_grad_hook(lambda param: self._gradient_ready(p))
        # torch < 2.1: a hook on the node that accumulates p's gradient (reached through a view of p,
        # whose grad_fn leads to it); the node must be kept alive, hence the reference in the handle.
        with torch.enable_grad():  # the view needs a grad_fn even when the optimizer is built under no_grad
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
        handle = accumulator.register_hook(lambda *unused: self._gradient_ready(p))
        return (accumulator, handle)

    def _gradient_ready(self, p):
        if self._passes_left[p] == 0:
            raise AssertionError(
                f"DistributedOptimizer (rank {rank()}): the gradient of {self._parameter_names[p]} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before step() or synchronize(); "
                "raise backward_passes_per_step to accumulate gradients locally")
        self._passes_left[p] -= 1
        if self._passes_left[p] > 0:
            return  # accumulating locally
        unit = self._unit_of[p]
        if isinstance(unit, tuple):
            self._group_ready[unit] += 1
            if self._group_ready[unit] < len(unit):
                return
        self._ready.add(unit)
        self._ready_sequence.append(unit)
        # Start this unit if it is next in the launch order, and the ready ones it held back.
        while self._next_launch < len(self._launch_order) and self._launch_order[self._next_launch] in self._ready:
            self._start(self._launch_order[self._next_launch])
            self._next_launch += 1

    def _scale_factors(self):
        # For Average, the collective divides by the number of ranks after the sum; the predivide
        # factor moves part of that division before the sum (to keep float16 sums in range).
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _payload(self, p):
        if p.grad is None:
            # No gradient on this rank (an unused parameter): it still takes part with zeros, since
            # another rank may have one.
            p.grad = torch.zeros_like(p)
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        return self._compression.compress(grad)

    def _start(self, unit):
        prescale, postscale = self._scale_factors()
        if isinstance(unit, tuple):
            tensors, contexts = zip(*[self._payload(p) for p in unit])
            handle = grouped_allreduce_async_(list(tensors), name=self._parameter_names[unit[0]], op=self.op,
                                              prescale_factor=prescale, postscale_factor=postscale,
                                              process_set=self.process_set)
            self._handles[unit] = (handle, contexts)
        else:
            tensor, context = self._payload(unit)
            handle = allreduce_async_(tensor, name=self._parameter_names[unit], op=self.op,
                                      prescale_factor=prescale, postscale_factor=postscale,
                                      process_set=self.process_set)
            self._handles[unit] = (handle, context)

    def _write_back(self, p, reduced, context):
        reduced = self._compression.decompress(reduced, context)
        if p.grad.is_sparse:
            p.grad = reduced.to_sparse()
        elif reduced is not p.grad:
            p.grad.copy_(reduced)

    def synchronize(self):
        """Waits for every gradient's allreduce (starting those backward did not) and puts the
        results into p.grad. After it, step() must run inside skip_synchronize()."""
        if not self.process_set.included():
            self._synchronized = True
            return
        if self._hooks:
            # The units backward did not make ready (unused parameters, or fewer passes than
            # backward_passes_per_step), and those that waited behind them, in the launch order.
            for unit in self._launch_order[self._next_launch:]:
                self._start(unit)
        for unit, (handle, context) in self._handles.items():
            reduced = synchronize(handle)
            if isinstance(unit, tuple):
                for p, tensor, ctx in zip(unit, reduced, context):
                    self._write_back(p, tensor, ctx)
            else:
                self._write_back(unit, reduced, context)
        self._handles.clear()
        if self._hooks and not self._order_learned:
            self._learn_launch_order()
        self._reset_passes()
        self._synchronized = True

    def _unit_name(self, unit):
        return self._parameter_names[unit[0] if isinstance(unit, tuple) else unit]

    def _learn_launch_order(self):
        """From now on, start the allreduces in the order rank 0's gradients became ready in this
        first step (one broadcast, once); units rank 0 did not see ready keep their order at the end."""
        root = self.process_set.ranks[0] if self.process_set.ranks else 0
        names = broadcast_object([self._unit_name(u) for u in self._ready_sequence], root_rank=root,
                                 name="DistributedOptimizer.order", process_set=self.process_set)
        learned = self._by_names(names, {self._unit_name(u): u for u in self._units}, root)
        seen = set(learned)
        self._launch_order = learned + [u for u in self._launch_order if u not in seen]
        self._order_learned = True

    def _reset_passes(self):
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step
        for unit in self._group_ready:
            self._group_ready[unit] = 0
        self._next_launch = 0
        self._ready.clear()
        self._ready_sequence.clear()

    @contextmanager
    def skip_synchronize(self):
        """`with optimizer.skip_synchronize(): optimizer.step()` steps without synchronizing again,
        after an explicit synchronize() (e.g. to clip the averaged gradients in between)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() outside "
                              "optimizer.skip_synchronize(): the gradients are reduced twice, which "
                              "costs time; wrap step() in `with optimizer.skip_synchronize():`")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        accumulating = any(left != self.backward_passes_per_step for left in self._passes_left.values())
        if self._handles or (self._hooks and accumulating):
            raise AssertionError(f"DistributedOptimizer (rank {rank()}): zero_grad() called after loss.backward() and before "
                                 "step() or synchronize(): the gradients' allreduces are in flight "
                                 "(or accumulating over backward_passes_per_step)")
        return super().zero_grad(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._handles.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._reset_passes()
        return super().load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        self._reset_passes()


def _adasum_pair(a, b):
    """Adasum of two vectors: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b. Orthogonal vectors add,
    equal ones give the vector once; a zero vector leaves the other as it is."""
    dot, aa, bb = torch.dot(a, b), torch.dot(a, a), torch.dot(b, b)
    a_scale = 1 - dot / (2 * aa) if aa > 0 else 0.0
    b_scale = 1 - dot / (2 * bb) if bb > 0 else 0.0
    return a_scale * a + b_scale * b


def _adasum(rows):
    """Adasum of the ranks' vectors (in rank order), in float64, over a binary tree as Horovod's
    recursive halving-doubling combines them: ranks 0+1, 2+3, ..., then those results pairwise.
    With a rank count that is not a power of two, the odd one out of a level goes up unchanged."""
    level = [row.double() for row in rows]
    while len(level) > 1:
        paired = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + level[len(level) - len(level) % 2:]
    return level[0]


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """op=hvd.Adasum, as Horovod's: each rank applies the wrapped optimizer to its own gradient, and
    the ranks' parameter changes (deltas), not their gradients, are combined with Adasum.

    The hook of a parameter runs the wrapped optimizer's step for that parameter alone, takes the
    delta and puts the parameter back, then starts an allgather of the delta (cohort has no Adasum
    reduction: each rank combines the gathered deltas itself, in the same order, so all get the same
    result; memory: one delta per rank). step() waits, and adds the combined delta to the parameter.
    """

    def _start(self, unit):
        p = unit
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        before = p.detach().clone()
        self._step_one_parameter(p)
        with torch.no_grad():
            delta = p.detach() - before
            p.copy_(before)
        payload, context = self._compression.compress(delta.reshape(1, -1))
        handle = allgather_async(payload, name=self._parameter_names[p], process_set=self.process_set)
        self._handles[p] = (handle, context)

    def _step_one_parameter(self, p):
        """The wrapped optimizer's step, with every parameter group holding only p (or nothing)."""
        kept = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if q is p]
            super(_DistributedOptimizer, self).step()
        finally:
            for group, params in zip(self.param_groups, kept):
                group["params"] = params

    def synchronize(self):
        for unit in self._launch_order[self._next_launch:]:
            self._start(unit)
        with torch.no_grad():
            for p, (handle, context) in self._handles.items():
                deltas = self._compression.decompress(synchronize(handle), context)
                p.add_(_adasum(list(deltas)).view_as(p).to(p.dtype))
        self._handles.clear()
        if not self._order_learned:
            self._learn_launch_order()
        self._reset_passes()

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("DistributedOptimizer: skip_synchronize() is not supported with op=hvd.Adasum "
                             "(its step happens in synchronize())")
        yield  # a generator, for contextmanager

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.synchronize()
        return loss


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wraps `optimizer` so that its gradients are reduced across the ranks with `op` (Average by
    default) before each step, the allreduces overlapping backward. The returned object is an
    instance of a subclass of `optimizer`'s class sharing its parameter groups and state; use it in
    `optimizer`'s place. See the module's docstring, and Horovod's documentation for the arguments.

    op=hvd.Adasum combines the ranks' parameter changes with Adasum (see _DistributedAdasumOptimizer),
    on the global process set only, without groups. Sparse gradients are reduced as dense tensors and
    made sparse again.
    """
    adasum = op == Adasum and size() > 1  # on one rank, Horovod too falls back to the plain optimizer
    if adasum and process_set is not global_process_set:
        raise NotImplementedError("DistributedOptimizer: op=hvd.Adasum works on the global process set only, as in Horovod")
    if adasum and groups is not None:
        raise ValueError("DistributedOptimizer: op=hvd.Adasum reduces each parameter on its own: groups do not apply")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("DistributedOptimizer: gradient_predivide_factor is only for op=hvd.Average")
    if backward_passes_per_step <= 0:
        raise ValueError("DistributedOptimizer: backward_passes_per_step must be > 0")
    if num_groups:
        warnings.warn("DistributedOptimizer: num_groups is Horovod's old name of groups", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("DistributedOptimizer: this optimizer is already a DistributedOptimizer")
    base = _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (base, optimizer.__class__), {})
    # The new object takes over the wrapped one's attributes (its param_groups, its state, its
    # defaults) rather than being constructed again, so nothing the optimizer already holds is lost.
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)
    distributed._setup_distributed(named_parameters, compression, backward_passes_per_step, op,
                                   gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return distributed
