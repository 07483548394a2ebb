"""The cpu backend's replay of recorded steps: a recording (core/graphs.py: the operators one step
called, with its tensors named as slots and constants) becomes a `Tape` of replay.cpp, which calls
the same operators with the same arguments from C++, no Python between them. Built with torch's
C++ extension loader on first use (as kernels.py builds the fused kernels), as a Python module.
One rewrite happens on the way (fuse_calls): pairs of calls whose intermediate nothing else reads
become one call with the same result, e.g. a step that ends in the greedy pick of its LM head's
logits calls linear_argmax instead of linear + argmax_rows (no logits in memory).

Threads per instruction: the engine runs small models on one intra-op thread (a tiny op loses more
to waking a second thread than it gains), but some calls of such a step are large, e.g. the LM
head of a 129,280-token vocabulary (10.4 ms on one core here, 4.9 ms on two; the fused kernels of a
batch-32 step of the test model measured no faster on two). The first replay of a tape times every
call that writes no argument (calling it again changes nothing) and takes over `_MIN_TRIED` on one
thread, on each thread count the accelerator offers (CpuAccelerator.tune_for_model: this process's
share of the cores), and finds the calls where a larger count saved at least `_MIN_GAIN` of the
call's time and `_MIN_SAVED` seconds. If those calls take at least `_MIN_SHARE` of the replay's time,
the whole tape runs at that count (`_whole_tape`; else just those calls, so one call that gained by
chance under load does not put every call on a contended core):
switching counts call by call leaves the second core idle between its calls, and waking it again
costs more than the small calls gain by staying on one (the test config V3, batch 1: 199 tok/s with
14 calls on two threads, 264 with the whole tape; a call too small to split runs on one thread at
any count, the kernels' grain sizes decide). Under load from other processes the timing finds no
call faster on two and the tape stays on one, until the next choice: every `_RECHOOSE_EVERY`
replays the tape times its calls again. DEEPINFER_CPU_THREADS set to a count fixes every call at
that count.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from deepinfer.backends.base import Const, Instruction, ReplayError, Var
from deepinfer.backends.cpu import kernels
from deepinfer.backends.cpu.extension_build import load_extension

_HERE = os.path.dirname(__file__)
_SOURCE = os.path.join(_HERE, "replay.cpp")
_lock = threading.Lock()
_module = None  # the built module, False if it cannot be built
_MIN_GAIN = 0.15  # a call keeps more threads only when they save this share of its time ...
_MIN_SAVED = 20e-6  # ... and at least this many seconds (waking a thread, this machine's noise)
_PROFILE_REPEATS = 3
_MIN_TRIED = 100e-6  # calls shorter than this on one thread are not tried on more
_MIN_SHARE = 0.25  # the calls faster on more threads take this share of the step: the whole tape goes
# Replays between two choices of threads (the first is made at the first replay). A choice made while
# other processes loaded the cores would otherwise stay for the life of the engine; a choice costs
# about ten replays' time, so re-choosing every 2048 replays costs < 1% (a few seconds of decoding).
_RECHOOSE_EVERY = 2048


def load():
    """The compiled replay module, or None (with a warning) where it cannot be built."""
    global _module
    with _lock:
        if _module is None:
            _module = _build() or False
        return _module or None


def _build():
    path = kernels.build_dir("replay", [_SOURCE])
    if not os.path.exists(os.path.join(path, "deepinfer_cpu_replay.so")):
        print("deepinfer: compiling the cpu backend's step replay (once, ~40 s)...", file=sys.stderr, flush=True)
    try:
        return load_extension(path, name="deepinfer_cpu_replay", sources=[_SOURCE], extra_cflags=["-O2"],
                              verbose=False)
    except Exception as exc:  # no compiler: steps run eagerly, op by op
        warnings.warn(f"deepinfer: the cpu step replay could not be built ({type(exc).__name__}); steps run "
                      "op by op", RuntimeWarning, stacklevel=3)
        return None


class TapeStep:
    """A compiled step: `step(inputs) -> outputs` (the recording's output tensors, new each call).
    A call that raises raises ReplayError, saying whether the tape had reached `first_write` (the
    first instruction that writes a pool or an input: Instruction.writes_state; None: none does) when
    it stopped. Not given, any failure counts as one that wrote."""

    def __init__(self, tape, options: list[int], first_write: int | None = 0):
        self.tape, self.options = tape, options
        self.first_write = first_write
        self.threads: list[int] | None = None  # chosen per instruction at the first call
        self.until_choice = 0  # replays before the threads are chosen (again)

    def _checked(self, call, *args, after_a_step: bool = False):
        """call(*args) on the tape; an exception becomes ReplayError. `after_a_step`: a whole step of
        the same replay ran before this call (run_steps after its profiled first step)."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - any operator's error, with where it stopped
            written = self.first_write is not None and (after_a_step or self.tape.completed() >= self.first_write)
            raise ReplayError(f"{type(exc).__name__}: {exc}", state_written=written) from exc

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.options and self.until_choice <= 0:
            outputs, seconds = self._checked(self.tape.profile, inputs, self.options, _PROFILE_REPEATS, _MIN_TRIED)
            self.threads = self._whole_tape([self._choose(times[:-1]) for times in seconds],
                                            [times[-1] for times in seconds])
            self.tape.set_threads(self.threads)
            self.until_choice = _RECHOOSE_EVERY
            return outputs
        self.until_choice -= 1
        return self._checked(self.tape.run, inputs)

    def run_steps(self, per_step: list[torch.Tensor], shared: list[torch.Tensor], steps: int,
                  feedback: list[tuple[int, int]], first: int = 0) -> list[torch.Tensor]:
        """`steps` replays in one C++ call: step s reads row first + s of each `per_step` tensor and
        all of `shared`, except input i of a (o, i) in `feedback`, which takes the step before's
        output o (from the second step on). -> each output stacked over the steps."""
        pairs = [v for pair in feedback for v in pair]
        previous, start = [], first
        if self.options and self.until_choice <= 0:  # this replay chooses the threads (__call__)
            previous = self([t[first] for t in per_step] + list(shared))
            start = first + 1
            if steps == 1:
                return [o[None] for o in previous]
        profiled = start - first
        self.until_choice -= steps - profiled
        out = self._checked(self.tape.run_steps, per_step, list(shared), start, steps - profiled, pairs, previous,
                            after_a_step=bool(profiled))
        return out if not profiled else [torch.cat([p[None], o]) for p, o in zip(previous, out)]

    def _choose(self, times: list[float]) -> int:
        if not times or times[0] < 0 or min(times) < 0:
            return 0
        best = min(range(len(times)), key=times.__getitem__)
        saved = times[0] - times[best]
        return self.options[best] if best and saved >= _MIN_GAIN * times[0] and saved >= _MIN_SAVED else 0

    @staticmethod
    def _whole_tape(chosen: list[int], seconds: list[float]) -> list[int]:
        """Every call at the largest count chosen when the calls that chose more threads took at least
        _MIN_SHARE of the replay's `seconds` (module doc); else the choice call by call."""
        best = max(chosen, default=0)
        gained = sum(t for c, t in zip(chosen, seconds) if c)
        return [best] * len(chosen) if best and gained >= _MIN_SHARE * sum(seconds) else chosen

    def threaded(self) -> list[tuple[str, int]]:
        """(operator, threads) of the calls that run on more than the default threads."""
        names = self.tape.op_names()
        return [(names[i], t) for i, t in enumerate(self.threads or []) if t]


def compile_recording(recording, thread_options: list[int] = (), fuse: bool = False) -> TapeStep | None:
    """The recording as a C++ tape, or None where the replay module cannot be built.
    `thread_options`: the thread counts its calls choose from at the first replay ([]: none).
    `fuse`: pairs of calls may become one kernel call (fuse_calls; the kernels are loaded)."""
    module = load()
    if module is None:
        return None
    from_var = [torch.empty(0) for _ in range(recording.num_vars)]  # stand-ins, matched by identity
    constants = recording.constants
    instructions = fuse_calls(recording.instructions, {o.index for o in recording.outputs}) if fuse \
        else list(recording.instructions)
    last_read: dict[int, int] = {}
    for k, ins in enumerate(instructions):
        for s in _slots_in((ins.args, ins.kwargs)):
            last_read[s] = k
    keep = {o.index for o in recording.outputs}
    frees: list[list[int]] = [[] for _ in instructions]
    for k, ins in enumerate(instructions):
        for s in ins.outs:  # returned, never read: released at once
            if s >= 0 and s not in last_read and s not in keep:
                frees[k].append(s)
    for s, k in last_read.items():
        if s not in keep:
            frees[k].append(s)
    tape = module.Tape(recording.num_vars, list(range(recording.num_inputs)), [o.index for o in recording.outputs])
    for shape, stride, dtype in recording.input_specs:
        tape.expect_input(torch.empty_strided(shape, stride, dtype=dtype, device="meta"))

    def value(a):
        if isinstance(a, Var):
            return from_var[a.index]
        if isinstance(a, Const):
            return constants[a.index]
        if isinstance(a, (list, tuple)):
            return type(a)(value(v) for v in a)
        return a

    for k, ins in enumerate(instructions):
        used = sorted(set(_slots_in((ins.args, ins.kwargs))))
        schema = ins.op._schema
        tape.add(schema.name, schema.overload_name, value(ins.args), {n: value(v) for n, v in ins.kwargs.items()},
                 [from_var[s] for s in used], used, ins.outs, frees[k])
    first_write = next((k for k, ins in enumerate(instructions) if ins.writes_state(recording.num_inputs)), None)
    return TapeStep(tape, list(thread_options), first_write)


def fuse_calls(instructions: list[Instruction], outputs: set[int]) -> list[Instruction]:
    """The instructions with two pairs of calls replaced by one call each, where nothing else reads
    the pair's intermediate and it is not a result of the step (same results, bit for bit):
    - argmax_rows(linear(x, w)) -> linear_argmax(x, w): the greedy pick of an LM head, as a multi-step
      greedy decode step ends (sampling_ops.cpp: the logits stay in cache);
    - x.to(bfloat16).to(float32) -> bf16_round(x): DeepSeek-V4.1's activation rounding (quant_ops.cpp:
      one pass, no bf16 intermediate).
    The fused call takes the first call's place."""
    cpu, to = torch.ops.deepinfer_cpu, torch.ops.aten.to.dtype

    def fusion(first: Instruction, second: Instruction) -> Instruction | None:
        if first.op is cpu.linear.default and second.op is cpu.argmax_rows.default and not second.kwargs:
            return Instruction(cpu.linear_argmax.default, first.args, first.kwargs, second.outs)
        if first.op is to and second.op is to and not first.kwargs and not second.kwargs \
                and first.args[1:] == (torch.bfloat16,) and second.args[1:] == (torch.float32,):
            return Instruction(cpu.bf16_round.default, first.args[:1], {}, second.outs)
        return None

    readers: dict[int, list[int]] = {}
    for k, ins in enumerate(instructions):
        for s in set(_slots_in((ins.args, ins.kwargs))):
            readers.setdefault(s, []).append(k)
    out: list[Instruction | None] = list(instructions)
    for k, ins in enumerate(instructions):
        if out[k] is None or len(ins.outs) != 1 or ins.outs[0] < 0 or ins.outs[0] in outputs:
            continue
        reads = readers.get(ins.outs[0], [])
        if len(reads) != 1 or out[reads[0]] is None:
            continue
        second = instructions[reads[0]]
        if second.args[:1] != (Var(ins.outs[0]),) or ins.outs[0] in set(_slots_in((second.args[1:], second.kwargs))):
            continue
        fused = fusion(ins, second)
        if fused is not None:
            out[k], out[reads[0]] = fused, None
    return [ins for ins in out if ins is not None]


def _slots_in(value):
    if isinstance(value, Var):
        yield value.index
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _slots_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _slots_in(v)
