"""Step graphs: a model's step recorded once per shape bucket from its one Python definition, then
replayed for every later step of that bucket: on cpu a C++ sequence of operator calls with no
Python between them (backends/cpu/replay.py), on nvidia a CUDA graph (backends/nvidia/graphs.py).

A decode step of a small model spends as long in Python (the graph's glue, op wrappers, the
dispatcher's Python entry) as in its kernels; on a GPU the same Python is the step's whole cost.
Nothing here knows a model: a step is `fn()` over the tensors its metadata holds
(`step_tensors(meta)`), and everything that decides which operators run with which arguments
(every shape, and the weights and cache pools, which stay for the engine's life) is fixed per
bucket. The bucket is the shapes and dtypes of those tensors, so two steps that would run
different operators (a compressed window finishing or not, another batch size) never share one.

How a step is recorded: at the dispatcher, under a TorchDispatchMode (`record`). Every operator
call that reaches it (aten ops, the cpu backend's fused kernels, any op a backend registers) is
kept with its arguments, its tensor arguments named as vars (the step's inputs and what earlier
calls returned) or constants (weights, pools, and views of them, taken once here). Calls that
change nothing are dropped (`.to()` of a tensor already there). A TorchFunctionMode watches for
what a replay could not repeat: a read of tensor data into Python (`.item()`, `.tolist()`, `if
tensor:`), a tensor made from Python values (`torch.tensor`), an operator whose output shape
depends on data (`nonzero`): such a bucket stays eager. The first two steps of a bucket are recorded
while they run eagerly, and the two recordings must be the same; only then is the bucket compiled,
and from its third step on replayed. Two equal recordings of different steps show that nothing
else (a tensor made from numpy inside the forward, a loop over data) changed what ran.

Why this mechanism (torch 2.13, this 2-core machine, the 4-layer test model; prototypes measured
with the tape below):
- torch.jit.trace records the same sequence and its C++ interpreter replays a batch-1 step in
  about the tape's time (0.21 ms against 0.21), but it is deprecated in torch 2.13 (a warning on
  every trace), freezes the control flow it saw without saying so (a step whose compressed window
  finished replayed the trace of one where none did: wrong logits, no error), and its constant
  handling is not ours to check (in-place writes into the cache pools through views did not all
  survive: pools differed from the eager step's).
- torch.fx symbolic tracing cannot run the graph at all: the forward branches on shapes and index
  arrays planned in numpy.
- torch.compile (Inductor) took 89 s to compile the batch-1 step and then ran it in 19.8 ms,
  against 0.9 ms eager (every fused kernel is an opaque custom op without a fake kernel, a graph
  break); AOTInductor needs a fake kernel per custom op (one per fused kernel, per quantized GEMM
  that lands later) and pays that compile time per bucket.
- The dispatcher recording above: ~250 lines of Python and C++, any registered op, and the recorded
  list is ours to inspect: checked twice before it is trusted, compared in tests, timed per
  instruction to choose threads (the cpu tape).
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import envs
from deepinfer.backends.base import Const, Instruction, ReplayError, Var


# Tensor methods and functions that move tensor data into Python values (or back): a replay would
# repeat the value seen while recording.
_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy",
               "__array__", "__format__", "__repr__", "tensor", "as_tensor", "asarray", "from_numpy"}
# Operators whose output shape depends on tensor data: later calls' recorded sizes would be stale.
_DATA_SHAPED = {"aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::argwhere",
                "aten::_local_scalar_dense", "aten::item"}


class RecorderFailed(str):
    """Why a step was not recorded, when the reason is the recorder's own error rather than the
    step's (a host read, a data-shaped op): that is a failure the engine warns about."""


def _is_view(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _same_view(view: torch.Tensor, base: torch.Tensor) -> bool:
    """A view that is its base again: same memory, shape and strides (reads and writes through either
    are the same)."""
    return (view.data_ptr() == base.data_ptr() and view.shape == base.shape and view.stride() == base.stride()
            and view.dtype == base.dtype)


def _flatten(value) -> list:
    """Tensors of a nested list/tuple result (others kept: the caller decides)."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return [value]


class Recording:
    """One step as the dispatcher saw it; `record` builds it."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.num_inputs = len(inputs)
        self.input_specs = [(tuple(t.shape), t.stride(), t.dtype) for t in inputs]
        self.instructions: list[Instruction] = []
        self.constants: list[torch.Tensor] = []
        # how each constant came about, for comparing recordings: ("tensor", id) for one that
        # existed before the step, ("view", op, args) for a view of constants taken during it
        self.constant_keys: list[tuple] = []
        self.num_vars = len(inputs)
        self.outputs: list[Var] = []
        self.structure = None  # how the step's result nests its tensors (tensor, or tuple)

    def same_as(self, other: "Recording") -> bool:
        """Whether two recordings ran the same operators on the same arguments (constants by
        identity): then the bucket's steps do not depend on anything but their inputs."""
        return (self.input_specs == other.input_specs and self.constant_keys == other.constant_keys
                and self.outputs == other.outputs and self.structure == other.structure
                and len(self.instructions) == len(other.instructions)
                and all(a.op is b.op and a.args == b.args and a.kwargs == b.kwargs and a.outs == b.outs
                        for a, b in zip(self.instructions, other.instructions)))

    def ops(self) -> list[str]:
        return [str(i.op) for i in self.instructions]

    def restore(self, outputs: list[torch.Tensor]):
        """The step's result in the shape `fn` returned it."""
        return outputs[0] if self.structure == "tensor" else tuple(outputs)


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._dynamo.disable unless this
        # says no: the first recorded call then imported torch._dynamo (1.5 s here, a third of a
        # 256-token batch-1 generate on tiny-dsv41) and every call went through its wrapper. Nothing
        # here runs under torch.compile, so there is nothing for that wrapper to guard.
        return False

    def __init__(self, recording: Recording, inputs: list[torch.Tensor]):
        super().__init__()
        self.rec = recording
        self.refs: dict[int, Var | Const] = {}  # id(tensor) -> its name while the tensor lives
        self.alive: list[weakref.finalize] = []
        for i, t in enumerate(inputs):
            self.refs.setdefault(id(t), Var(i))
        self.failure: str | None = None

    def _name(self, t: torch.Tensor) -> Var | Const:
        ref = self.refs.get(id(t))
        if ref is None:  # existed before the step: a weight, a pool, a table
            ref = self._constant(t, ("tensor", id(t)))
        return ref

    def _constant(self, t: torch.Tensor, key: tuple) -> Const:
        rec = self.rec
        ref = Const(len(rec.constants))
        rec.constants.append(t)  # held: the id stays this tensor's
        rec.constant_keys.append(key)
        self.refs[id(t)] = ref
        return ref

    def _new_var(self, t: torch.Tensor) -> Var:
        ref = Var(self.rec.num_vars)
        self.rec.num_vars += 1
        self.refs[id(t)] = ref
        # forget the id when the tensor dies: Python may give a later tensor the same id
        self.alive.append(weakref.finalize(t, self.refs.pop, id(t), None))
        return ref

    def _canon(self, a):
        if isinstance(a, torch.Tensor):
            return self._name(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self._canon(v) for v in a)
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failure is not None:
            return out
        try:
            self._note(func, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - a recorder bug must not break the eager step it watches
            self.failure = RecorderFailed(f"recording {func} raised {type(exc).__name__}: {exc}")
        return out

    def _note(self, func, args, kwargs, out) -> None:
        name = func._schema.name
        if name in _DATA_SHAPED or (func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            self.failure = f"{func}: its output shape depends on tensor data"
            return
        cargs, ckwargs = self._canon(args), {k: self._canon(v) for k, v in kwargs.items()}
        results = _flatten(out)
        if any(not isinstance(r, torch.Tensor) for r in results if r is not None):
            self.failure = f"{func} returned a Python value"
            return
        tensor_args = [a for a in _flatten(list(cargs) + list(ckwargs.values())) if isinstance(a, (Var, Const))]
        if _is_view(func):
            if all(isinstance(a, Const) for a in tensor_args):
                for r in results:  # a view of constants is a constant: taken once, here
                    if id(r) not in self.refs:
                        self._constant(r, ("view", func, cargs, tuple(sorted(ckwargs.items()))))
                return
            base = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if len(results) == 1 and base is not None and _same_view(results[0], base):
                self.refs[id(results[0])] = self._name(base)  # the whole tensor (x[:], a same-shape view)
                self.alive.append(weakref.finalize(results[0], self.refs.pop, id(results[0]), None))
                return
        outs = []
        for r in results:
            if r is None or id(r) in self.refs:  # returned an argument (in place, or a no-op)
                outs.append(-1)
            else:
                outs.append(self._new_var(r).index)
        if not func._schema.is_mutable and all(o < 0 for o in outs):
            return  # changed nothing, made nothing
        self.rec.instructions.append(Instruction(func, cargs, ckwargs, outs))


class _HostReads(TorchFunctionMode):
    """Notes the first read of tensor data into Python during a recorded step."""

    def __init__(self):
        super().__init__()
        self.failure: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.failure is None and getattr(func, "__name__", None) in _HOST_READS:
            self.failure = f"{func.__name__}: the step reads tensor data into Python"
        return func(*args, **(kwargs or {}))


def record(fn: Callable[[], Any], inputs: list[torch.Tensor]) -> tuple[Recording | None, str | None, Any]:
    """Run `fn()` eagerly (its results and side effects are the step's) while recording the
    operators it calls. -> (the recording, or None with the reason it cannot be replayed, fn's result)."""
    rec = Recording(inputs)
    recorder, reads = _Recorder(rec, inputs), _HostReads()
    with torch.inference_mode(), reads, recorder:
        result = fn()
    failure = reads.failure or recorder.failure
    if failure is None:
        results = _flatten(result)
        rec.structure = "tensor" if isinstance(result, torch.Tensor) else len(results)
        for r in results:
            ref = recorder.refs.get(id(r)) if isinstance(r, torch.Tensor) else None
            if not isinstance(ref, Var):
                failure = "the step's result is not a tensor it computed"
                break
            rec.outputs.append(ref)
    for f in recorder.alive:
        f.detach()
    return (None if failure else rec), failure, result


def signature(tensors: list[torch.Tensor]) -> tuple:
    """A step's bucket: the shapes and dtypes of its tensors (and which of them are one tensor)."""
    key = tuple((t.shape, t.dtype) for t in tensors)
    ids = [id(t) for t in tensors]
    if len(set(ids)) < len(ids):
        key += (tuple(ids.index(i) for i in ids),)
    return key


def _first_step_signature(per_step: list[torch.Tensor], shared: list[torch.Tensor]) -> tuple:
    """signature([t[0] for t in per_step] + shared) without making the row views (each a distinct
    tensor: only `shared` can repeat one)."""
    key = tuple((t.shape[1:], t.dtype) for t in per_step) + tuple((t.shape, t.dtype) for t in shared)
    ids = [id(t) for t in shared]
    if len(set(ids)) < len(ids):
        key += (tuple(range(len(per_step))) + tuple(len(per_step) + ids.index(i) for i in ids),)
    return key


# ---------------------------------------------------------------- buckets
@dataclasses.dataclass(slots=True)
class _Bucket:
    recording: Recording | None = None
    step: Callable | None = None  # the compiled replay
    eager: str | None = None  # why this bucket runs eagerly for good
    replays: int = 0


def bucket_name(bucket_key: tuple) -> str:
    """How a warning names a bucket: its kind (the key's first item), the shape of its first input,
    and a digest of the whole key (the sizes and every input's shape: hundreds of characters)."""
    first = next((part for part in bucket_key if isinstance(part, tuple) and len(part) == 2
                  and isinstance(part[0], torch.Size)), None)
    shape = f", first input {list(first[0])} {str(first[1]).removeprefix('torch.')}" if first else ""
    digest = hashlib.blake2s(repr(bucket_key).encode(), digest_size=4).hexdigest()
    return f"{bucket_key[0]!r} step bucket {digest}{shape}"


class StepGraphs:
    """The captured steps of one model on one cache: bucket -> replay. `run` takes a step (fn, the
    tensors it reads), records or replays it, and returns what fn returns.

    `max_tokens`: the largest step recorded (decode batches; prefill steps run eagerly: their
    shapes rarely repeat and a recording keeps every intermediate of the step until its end).
    `max_buckets`: compiled buckets kept (least recently used dropped).

    Capture is on by default where the accelerator offers it, so a bucket whose capture or replay
    fails must not take the engine down: compiling it (compile_step) raised, its replay raised
    (a CUDA graph's capture happens at its first replay), or the recorder itself raised. The bucket
    is then failed: one RuntimeWarning names it, its steps run eagerly from then on (the step that
    failed too), other buckets are unaffected, and `failed` remembers it past eviction, so it is
    never captured (or warned about) again. A replay that failed after it had written state that
    outlives the step (a cache pool: ReplayError.state_written) cannot be run again eagerly, since
    the eager step would start from half a step's writes: that raises instead, naming the bucket."""

    def __init__(self, accel, max_tokens: int, max_buckets: int = 256):
        self.accel, self.max_tokens, self.max_buckets = accel, max_tokens, max_buckets
        self.buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self.failed: dict[tuple, str] = {}  # bucket key -> why its capture or replay failed
        self.stats = {"recorded": 0, "replayed": 0, "eager": 0, "compiled": 0, "failed": 0}

    def padded_batch(self, batch: int) -> int:
        """The batch size a decode step of `batch` sequences runs at: itself, or where the accelerator
        pads batches (pad_graph_batches), the next of 1, 2, 4 and the multiples of
        DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL (0: no padding), never past max_tokens."""
        interval = envs.get("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL")
        if not self.accel.pad_graph_batches or interval <= 0 or batch >= self.max_tokens:
            return batch
        size = 1 << (batch - 1).bit_length() if batch <= 4 else -(-batch // interval) * interval
        return min(max(size, batch), self.max_tokens)

    @staticmethod
    def enabled(accel) -> bool:
        """Whether steps are captured at all: the accelerator can replay them and
        DEEPINFER_ENFORCE_EAGER is off."""
        return accel.step_graphs and not envs.get("DEEPINFER_ENFORCE_EAGER")

    def _fail(self, bucket_key: tuple, bucket: _Bucket, why: str) -> None:
        """The bucket's capture or replay failed: eager for good, said once."""
        bucket.step, bucket.recording, bucket.eager = None, None, f"failed: {why}"
        self.failed[bucket_key] = why
        self.stats["failed"] += 1
        warnings.warn(f"deepinfer: {bucket_name(bucket_key)} could not be captured or replayed ({why}); its steps "
                      "run eagerly from now on (slower, same results)", RuntimeWarning, stacklevel=3)

    def _replay_failed(self, bucket_key: tuple, bucket: _Bucket, exc: Exception) -> None:
        """A replay raised: fail the bucket, and raise if the replay had written state already."""
        why = f"its replay raised {exc}" if isinstance(exc, ReplayError) else \
            f"its replay raised {type(exc).__name__}: {exc}"
        self._fail(bucket_key, bucket, why)
        if not isinstance(exc, ReplayError) or exc.state_written:
            raise RuntimeError(
                f"deepinfer: the replay of {bucket_name(bucket_key)} failed after it had written the cache "
                f"({why}): the step's sequences cannot be rolled back, so the engine stops rather than continue "
                "from a half-written step. DEEPINFER_ENFORCE_EAGER=1 runs every step eagerly") from exc

    def run(self, key: tuple, fn: Callable[[], Any], inputs: list[torch.Tensor],
            step_fn: Callable[[list[torch.Tensor]], Any] | None = None):
        """One step. `key` names the kind of step and what else decides its operators (e.g. the
        sizes its metadata holds); the bucket is it plus the inputs' signature. `step_fn(tensors)`
        runs the same step on other tensors (a backend that captures by running the step on static
        buffers needs it)."""
        bucket_key = key + signature(inputs)
        bucket = self.buckets.get(bucket_key)
        if bucket is None:
            bucket = self.buckets[bucket_key] = _Bucket()
            if bucket_key in self.failed:  # evicted after it failed: still eager
                bucket.eager = f"failed: {self.failed[bucket_key]}"
        else:
            self.buckets.move_to_end(bucket_key)
        if bucket.eager is not None:
            self.stats["eager"] += 1
            return fn()
        if bucket.step is not None:
            recording = bucket.recording
            try:
                outputs = bucket.step(inputs)
            except Exception as exc:  # noqa: BLE001 - any backend's error: the bucket goes eager
                self._replay_failed(bucket_key, bucket, exc)
                self.stats["eager"] += 1
                return fn()
            bucket.replays += 1
            self.stats["replayed"] += 1
            return recording.restore(outputs)
        recording, failure, result = record(fn, inputs)
        self.stats["recorded"] += 1
        if recording is None:
            if isinstance(failure, RecorderFailed):
                self._fail(bucket_key, bucket, failure)
            bucket.eager = bucket.eager or failure
        elif bucket.recording is None:
            bucket.recording = recording
        elif not bucket.recording.same_as(recording):
            bucket.eager, bucket.recording = "two steps of the bucket ran different operators", None
        else:
            try:
                bucket.step = self.accel.compile_step(recording, step_fn)
            except Exception as exc:  # noqa: BLE001 - the step already ran eagerly: only the bucket goes eager
                self._fail(bucket_key, bucket, f"compiling it raised {type(exc).__name__}: {exc}")
            else:
                if bucket.step is None:
                    bucket.eager, bucket.recording = "the accelerator cannot replay it", None
                else:
                    bucket.recording = recording
                    self.stats["compiled"] += 1
        self._evict()
        return result

    def run_steps(self, key: tuple, per_step: list[torch.Tensor], shared: list[torch.Tensor], steps: int,
                  feedback: list[tuple[int, int]], step_fn: Callable[[list[torch.Tensor]], Any],
                  first: int = 0) -> list[torch.Tensor]:
        """`steps` steps of one bucket (multi-step decoding). Step s runs `step_fn(inputs)` on row
        first + s of every `per_step` tensor followed by `shared`, except that input i of each (o, i) in
        `feedback` takes output o of the step before (from the second step on). A compiled bucket
        whose replay runs several steps per call (the cpu tape) takes them all in one call.
        -> step_fn's outputs, each stacked over the steps."""
        bucket_key = key + _first_step_signature(per_step, shared)
        bucket = self.buckets.get(bucket_key)
        many = getattr(bucket.step, "run_steps", None) if bucket is not None and bucket.step is not None else None
        if many is not None:
            try:
                out = many(per_step, list(shared), steps, feedback, first)
            except Exception as exc:  # noqa: BLE001 - as in run: eager from the first step, or raise
                self._replay_failed(bucket_key, bucket, exc)
            else:
                bucket.replays += steps
                self.stats["replayed"] += steps
                return out
        outs, previous = [], None
        for s in range(first, first + steps):
            inputs = [t[s] for t in per_step] + list(shared)
            if previous is not None:
                for o, i in feedback:
                    inputs[i] = previous[o]
            result = self.run(key, lambda: step_fn(inputs), inputs, step_fn)
            previous = [result] if isinstance(result, torch.Tensor) else list(result)
            outs.append(previous)
        return [torch.stack(column) for column in zip(*outs)]

    def _evict(self) -> None:
        """Keep the `max_buckets` most recently used buckets (a bucket that keeps recurring is
        recompiled after an eviction, in two steps)."""
        while len(self.buckets) > self.max_buckets:
            self.buckets.popitem(last=False)
