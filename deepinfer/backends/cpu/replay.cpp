// The cpu backend's step replay: a recorded step (core/graphs.py records the model's Python graph
// at the dispatcher) run as a sequence of operator calls from C++, with no Python between them, the
// way a CUDA graph replays a captured stream. Loaded by replay.py as a Python module.
//
// Nothing here knows a model. An instruction is an operator (any registered one: aten, the fused
// kernels of fused_ops.cpp, a quantized GEMM added later) with its recorded arguments; the tensors
// among them are constants (weights, cache pools, views of them), held here, or slots: the step's
// inputs and what earlier instructions returned. A replay fills the input slots, calls each
// operator through the dispatcher with the slots patched into its arguments, and returns the output
// slots. Same operators, same arguments, same order: the results and every in-place write into the
// pools are the eager step's, bit for bit (tests/unit/test_step_graphs.py).

#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// A tensor argument to fill in at replay: argument `arg` (element `elem` of a list argument, or the
// argument itself when -1) takes slot `slot`.
struct Patch {
  int32_t arg, elem, slot;
};

struct Instruction {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // as recorded, slot tensors left undefined
  std::vector<Patch> patches;
  std::vector<int32_t> outs;   // slot of each returned tensor (tensor lists flattened), -1: not kept
  std::vector<int32_t> frees;  // slots last read here, released after the call
  int32_t threads = 0;         // intra-op threads for this call, 0: whatever is set
  bool pure = false;           // no argument is written: safe to call again (profile)
  explicit Instruction(c10::OperatorHandle handle) : op(std::move(handle)) {}
};

struct InputSpec {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
};

class Tape {
 public:
  Tape(int64_t num_slots, std::vector<int64_t> inputs, std::vector<int64_t> outputs)
      : slots_(num_slots), inputs_(inputs.begin(), inputs.end()), outputs_(outputs.begin(), outputs.end()) {}

  // Append one operator call. `args`/`kwargs` as Python gave them to the operator, with slot tensors
  // replaced by the placeholder tensors `slot_tensors` (matched by identity) for slots `slot_ids`.
  void add(const std::string& name, const std::string& overload, py::tuple args, py::dict kwargs,
           const std::vector<at::Tensor>& slot_tensors, const std::vector<int64_t>& slot_ids,
           const std::vector<int64_t>& outs, const std::vector<int64_t>& frees) {
    c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const c10::FunctionSchema& schema = handle.schema();
    Instruction ins(handle);
    ins.args = torch::jit::createStackForSchema(schema, torch::jit::tuple_slice(wrap_numbers(schema, args)),
                                                to_kwargs(kwargs), std::nullopt);
    std::unordered_map<const c10::TensorImpl*, int32_t> slot_of;
    for (size_t i = 0; i < slot_tensors.size(); ++i)
      slot_of[slot_tensors[i].unsafeGetTensorImpl()] = static_cast<int32_t>(slot_ids[i]);
    auto slot_for = [&](const c10::IValue& v) -> int32_t {
      if (!v.isTensor() || !v.toTensor().defined()) return -1;
      auto it = slot_of.find(v.toTensor().unsafeGetTensorImpl());
      return it == slot_of.end() ? -1 : it->second;
    };
    for (size_t a = 0; a < ins.args.size(); ++a) {
      c10::IValue& v = ins.args[a];
      if (int32_t s = slot_for(v); s >= 0) {
        ins.patches.push_back({static_cast<int32_t>(a), -1, s});
        v = at::Tensor();
      } else if (v.isList()) {
        c10::List<c10::IValue> list = v.toList();
        for (size_t j = 0; j < list.size(); ++j) {
          if (int32_t s = slot_for(list.get(j)); s >= 0) {
            ins.patches.push_back({static_cast<int32_t>(a), static_cast<int32_t>(j), s});
            list.set(j, at::Tensor());
          }
        }
      }
    }
    std::unordered_map<int32_t, bool> found;
    for (const Patch& p : ins.patches) found[p.slot] = true;
    TORCH_CHECK(found.size() == slot_tensors.size(), "replay: ", name, ": ", slot_tensors.size(),
                " slots given, ", found.size(), " found among the arguments");
    ins.outs.assign(outs.begin(), outs.end());
    ins.frees.assign(frees.begin(), frees.end());
    ins.pure = !schema.is_mutable();
    instructions_.push_back(std::move(ins));
  }

  // What every replay's inputs must look like (the recorded step's): a step of another shape is a
  // bug of the caller's bucketing, refused here rather than run with stale sizes.
  void expect_input(const at::Tensor& example) {
    input_specs_.push_back({example.sizes().vec(), example.strides().vec(), example.scalar_type()});
  }

  void set_threads(const std::vector<int64_t>& threads) {
    TORCH_CHECK(threads.size() == instructions_.size(), "replay: one thread count per instruction");
    for (size_t i = 0; i < threads.size(); ++i) instructions_[i].threads = static_cast<int32_t>(threads[i]);
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_release no_gil;  // only the dispatcher and kernels from here on
    completed_ = 0;
    return execute(inputs, nullptr, {});
  }

  // `steps` replays in a row (multi-step decoding), one Python call: step s takes row first + s of
  // each of `per_step` and all of `shared` as its inputs (in that order), except that input
  // feedback[2k + 1] takes the step before's output feedback[2k] (from `previous`, the outputs of
  // the step before this call, for the first step when given). -> every output, stacked over steps.
  std::vector<at::Tensor> run_steps(const std::vector<at::Tensor>& per_step, const std::vector<at::Tensor>& shared,
                                    int64_t first, int64_t steps, const std::vector<int64_t>& feedback,
                                    const std::vector<at::Tensor>& previous) {
    py::gil_scoped_release no_gil;
    completed_ = 0;
    TORCH_CHECK(feedback.size() % 2 == 0, "replay: feedback is (output, input) pairs");
    std::vector<std::vector<at::Tensor>> outputs(outputs_.size());
    std::vector<at::Tensor> inputs(per_step.size() + shared.size()), last = previous;
    for (size_t i = 0; i < shared.size(); ++i) inputs[per_step.size() + i] = shared[i];
    for (int64_t s = 0; s < steps; ++s) {
      for (size_t i = 0; i < per_step.size(); ++i) inputs[i] = per_step[i].select(0, first + s);
      if (!last.empty())
        for (size_t k = 0; k < feedback.size(); k += 2) inputs[feedback[k + 1]] = last[feedback[k]];
      last = execute(inputs, nullptr, {});
      for (size_t o = 0; o < last.size(); ++o) outputs[o].push_back(last[o]);
    }
    std::vector<at::Tensor> stacked;
    for (auto& o : outputs) stacked.push_back(at::stack(o));
    return stacked;
  }

  // One replay that also times every pure instruction at each of `thread_counts` (median of
  // `repeats` further calls): [instruction][option] seconds, -1 for instructions not timed, and
  // last the seconds of the replay's own call of every instruction. Calls
  // under `min_seconds` at the first count are not tried at the others (a thread's wake-up alone
  // costs more). Calling a pure operator again changes nothing: the step's results are unaffected.
  std::pair<std::vector<at::Tensor>, std::vector<std::vector<double>>> profile(
      const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& thread_counts, int64_t repeats,
      double min_seconds) {
    py::gil_scoped_release no_gil;
    completed_ = 0;
    std::vector<std::vector<double>> seconds(instructions_.size(),
                                             std::vector<double>(thread_counts.size() + 1, -1.0));
    auto out = execute(inputs, &seconds, {thread_counts, repeats, min_seconds});
    return {out, seconds};
  }

  int64_t size() const { return static_cast<int64_t>(instructions_.size()); }

  // Instructions the last run, run_steps or profile call finished (over all its steps): where one
  // that raised stopped, so the caller can tell whether it had written state (replay.py).
  int64_t completed() const { return completed_; }

  std::vector<std::string> op_names() const {
    std::vector<std::string> names;
    for (const Instruction& ins : instructions_) names.push_back(c10::toString(ins.op.operator_name()));
    return names;
  }

 private:
  struct Timing {
    std::vector<int64_t> thread_counts;
    int64_t repeats = 0;
    double min_seconds = 0.0;
  };

  static py::kwargs to_kwargs(const py::dict& kwargs) {
    py::kwargs out;
    for (auto item : kwargs) out[item.first] = item.second;
    return out;
  }

  // The dispatcher hands a Python mode a scalar operand of a Tensor parameter as a number (`t + 1`
  // is add.Tensor(t, 1)); the schema wants a tensor: a wrapped-number tensor, as the eager call made.
  static py::tuple wrap_numbers(const c10::FunctionSchema& schema, const py::tuple& args) {
    const auto& params = schema.arguments();
    py::list fixed;
    for (size_t i = 0; i < args.size(); ++i) {
      py::object a = args[i];
      const bool number = py::isinstance<py::int_>(a) || py::isinstance<py::float_>(a) || py::isinstance<py::bool_>(a);
      if (number && i < params.size() && params[i].type()->kind() == c10::TypeKind::TensorType) {
        at::Tensor t = at::scalar_to_tensor(torch::jit::toIValue(a, c10::NumberType::get()).toScalar());
        t.unsafeGetTensorImpl()->set_wrapped_number(true);
        a = py::cast(t);
      }
      fixed.append(a);
    }
    return py::tuple(fixed);
  }

  void check_inputs(const std::vector<at::Tensor>& inputs) const {
    TORCH_CHECK(inputs.size() == inputs_.size(), "replay: ", inputs.size(), " inputs, the recorded step had ",
                inputs_.size());
    for (size_t i = 0; i < input_specs_.size() && i < inputs.size(); ++i) {
      const InputSpec& spec = input_specs_[i];
      const at::Tensor& t = inputs[i];
      TORCH_CHECK(t.scalar_type() == spec.dtype && t.sizes() == c10::IntArrayRef(spec.sizes) &&
                      t.strides() == c10::IntArrayRef(spec.strides),
                  "replay: input ", i, " is ", t.sizes(), " ", t.scalar_type(), ", the recorded step's was ",
                  c10::IntArrayRef(spec.sizes), " ", spec.dtype);
    }
  }

  void call(Instruction& ins, torch::jit::Stack& stack) {
    stack.assign(ins.args.begin(), ins.args.end());
    for (const Patch& p : ins.patches) {
      if (p.elem < 0) stack[p.arg] = slots_[p.slot];
      else stack[p.arg].toList().set(p.elem, slots_[p.slot]);  // the list is shared with `args`
    }
    ins.op.callBoxed(stack);
    for (const Patch& p : ins.patches)  // drop the list's references: the slot may be freed below
      if (p.elem >= 0) ins.args[p.arg].toList().set(p.elem, at::Tensor());
  }

  std::vector<at::Tensor> execute(const std::vector<at::Tensor>& inputs, std::vector<std::vector<double>>* seconds,
                                  const Timing& timing) {
    c10::InferenceMode inference;  // as the eager step: no autograd records, inference tensors
    check_inputs(inputs);
    for (size_t i = 0; i < inputs.size(); ++i) slots_[inputs_[i]] = inputs[i];
    const int saved_threads = at::get_num_threads();
    int threads_now = saved_threads;
    torch::jit::Stack& stack = stack_;
    try {
      for (size_t k = 0; k < instructions_.size(); ++k) {
        Instruction& ins = instructions_[k];
        if (seconds != nullptr && ins.pure) {
          time_instruction(ins, stack, timing, (*seconds)[k]);
          threads_now = -1;  // timing changed it
        }
        const int threads = ins.threads > 0 ? ins.threads : saved_threads;
        if (threads != threads_now) at::set_num_threads(threads_now = threads);
        if (seconds != nullptr) {
          const auto start = std::chrono::steady_clock::now();
          call(ins, stack);
          (*seconds)[k].back() = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        } else {
          call(ins, stack);
        }
        size_t r = 0;
        for (c10::IValue& v : stack) {
          if (v.isTensor()) {
            const int32_t s = ins.outs[r++];
            if (s >= 0) slots_[s] = std::move(v).toTensor();
          } else if (v.isTensorList()) {
            for (const at::Tensor& t : v.toTensorVector()) {
              const int32_t s = ins.outs[r++];
              if (s >= 0) slots_[s] = t;
            }
          }
        }
        stack.clear();
        for (int32_t s : ins.frees) slots_[s].reset();
        ++completed_;
      }
    } catch (...) {
      if (saved_threads != at::get_num_threads()) at::set_num_threads(saved_threads);
      for (auto& s : slots_) s.reset();
      stack.clear();
      throw;
    }
    if (saved_threads != threads_now) at::set_num_threads(saved_threads);
    std::vector<at::Tensor> out;
    out.reserve(outputs_.size());
    for (int64_t s : outputs_) out.push_back(std::move(slots_[s]));
    for (int64_t i : inputs_) slots_[i].reset();
    return out;
  }

  void time_instruction(Instruction& ins, torch::jit::Stack& stack, const Timing& timing, std::vector<double>& out) {
    using clock = std::chrono::steady_clock;
    for (size_t o = 0; o < timing.thread_counts.size(); ++o) {
      at::set_num_threads(static_cast<int>(timing.thread_counts[o]));
      call(ins, stack);  // once untimed: caches, the thread pool's wake-up
      stack.clear();
      std::vector<double> runs;
      for (int64_t r = 0; r < timing.repeats; ++r) {
        const auto start = clock::now();
        call(ins, stack);
        runs.push_back(std::chrono::duration<double>(clock::now() - start).count());
        stack.clear();
      }
      std::nth_element(runs.begin(), runs.begin() + runs.size() / 2, runs.end());
      out[o] = runs.empty() ? -1.0 : runs[runs.size() / 2];
      if (o == 0 && out[o] < timing.min_seconds) break;
    }
  }

  std::vector<at::Tensor> slots_;
  torch::jit::Stack stack_;
  std::vector<int64_t> inputs_, outputs_;
  std::vector<Instruction> instructions_;
  std::vector<InputSpec> input_specs_;
  int64_t completed_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Tape>(m, "Tape")
      .def(py::init<int64_t, std::vector<int64_t>, std::vector<int64_t>>())
      .def("add", &Tape::add)
      .def("expect_input", &Tape::expect_input)
      .def("set_threads", &Tape::set_threads)
      .def("run", &Tape::run)
      .def("run_steps", &Tape::run_steps)
      .def("profile", &Tape::profile)
      .def("op_names", &Tape::op_names)
      .def("completed", &Tape::completed)
      .def("__len__", &Tape::size);
}
