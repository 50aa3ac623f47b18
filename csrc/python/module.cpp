// Python bindings of the runtime glue: device table, memory limits and op records.
#include "../aten/aten.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>
#include <torch/csrc/utils/pybind.h>

#include <unordered_set>


namespace {

// The user's source line for the stream checker's reports: the innermost Python frame
// outside torch and torch_neuronx.
std::string python_where() {
  if (!Py_IsInitialized()) return "<no Python>";
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();
  if (!frame) return "<autograd or C++ thread>";
  Py_INCREF(frame);
  std::string fallback;
  while (frame) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    std::string f = file ? file : "?";
    std::string where = f + ":" + std::to_string(PyFrame_GetLineNumber(frame));
    Py_DECREF(code);
    if (fallback.empty()) fallback = where;
    bool internal = f.find("/torch/") != std::string::npos ||
                    f.find("/torch_neuronx/") != std::string::npos || f.rfind("<", 0) == 0;
    if (!internal) {
      Py_DECREF(frame);
      return where;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  return fallback;
}

// A launch site: the innermost few frames' code and instruction offset, cheap to take at
// every launch. Code objects are kept alive once seen (they are few), so a site can be
// described long after its frames are gone.
neuron::queue::Site capture_site() {
  static std::unordered_set<PyCodeObject*> kept;
  neuron::queue::Site s;
  // PyTorch releases the GIL around every op; frames of this thread are only valid under it.
  if (!Py_IsInitialized() || !PyGILState_GetThisThreadState()) return s;
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* f = PyEval_GetFrame();
  if (!f) return s;
  Py_INCREF(f);
  while (f && s.n < 4) {
    PyCodeObject* code = PyFrame_GetCode(f);
    if (kept.insert(code).second) Py_INCREF(code);
    Py_DECREF(code);
    s.code[s.n] = code;
    s.lasti[s.n] = PyFrame_GetLasti(f);
    ++s.n;
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  return s;
}

// The first frame outside torch and torch_neuronx, as "file:line".
std::string describe_site(const neuron::queue::Site& s) {
  if (s.n == 0) return "";
  if (!Py_IsInitialized()) return "";
  pybind11::gil_scoped_acquire gil;
  std::string first;
  for (int i = 0; i < s.n; ++i) {
    auto* code = static_cast<PyCodeObject*>(const_cast<void*>(s.code[i]));
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    std::string f = file ? file : "?";
    std::string where = f + ":" + std::to_string(PyCode_Addr2Line(code, s.lasti[i]));
    if (first.empty()) first = where;
    bool internal = f.find("/torch/") != std::string::npos ||
                    f.find("/torch_neuronx/") != std::string::npos || f.rfind("<", 0) == 0;
    if (!internal) return where;
  }
  return first;
}

// The Python dtype policy (set by torch_neuronx.cuda_dtypes), called with the op's name,
// overload and host-alias arguments; it answers None (not its case) or the op's results.
// Leaked on purpose: a static py::object would be released after the interpreter is gone.
PyObject* g_retry_policy = nullptr;

// Calls `fn(name, overload, args)` for the op on the stack; None: not its case, else the
// results replace the arguments.
bool call_python_op(PyObject* fn, const char* who, const c10::OperatorHandle& op,
                    torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  pybind11::tuple args(n);
  for (size_t i = 0; i < n; ++i) args[i] = torch::jit::toPyObject((*stack)[base + i]);
  pybind11::object out = pybind11::reinterpret_borrow<pybind11::object>(fn)(schema.name(), schema.overload_name(), args);
  if (out.is_none()) return false;
  const auto& rets = schema.returns();
  std::vector<c10::IValue> results;
  if (rets.size() == 1) {
    results.push_back(torch::jit::toIValue(out, rets[0].type()));
  } else {
    auto seq = out.cast<pybind11::sequence>();
    TORCH_CHECK(seq.size() == rets.size(), schema.operator_name(), ": ", who, " returned ",
                seq.size(), " results, the schema has ", rets.size());
    for (size_t j = 0; j < rets.size(); ++j) results.push_back(torch::jit::toIValue(seq[j], rets[j].type()));
  }
  torch::jit::drop(*stack, n);
  for (auto& r : results) stack->push_back(std::move(r));
  return true;
}

bool dtype_retry(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!Py_IsInitialized()) return false;
  pybind11::gil_scoped_acquire gil;
  if (!g_retry_policy) return false;
  return call_python_op(g_retry_policy, "the dtype policy", op, stack);
}

PyObject* g_ahead_policy = nullptr;  // the policy asked before waiting (leaked, as above)

bool dtype_ahead(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!Py_IsInitialized()) return false;
  pybind11::gil_scoped_acquire gil;
  if (!g_ahead_policy) return false;
  return call_python_op(g_ahead_policy, "the dtype policy", op, stack);
}

// Stochastic rounding's Python side (torch_neuronx.kernels.stochastic_rounding); leaked
// as the dtype policy is.
PyObject* g_sr_op = nullptr;
PyObject* g_sr_copy = nullptr;

bool sr_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!Py_IsInitialized()) return false;
  pybind11::gil_scoped_acquire gil;
  if (!g_sr_op) return false;
  return call_python_op(g_sr_op, "stochastic rounding", op, stack);
}

void sr_copy(const at::Tensor& src, const at::Tensor& dst) {
  pybind11::gil_scoped_acquire gil;
  pybind11::reinterpret_borrow<pybind11::object>(g_sr_copy)(src, dst);
}

// Backend tensor metadata (torch._utils.set_tensor_metadata / get_tensor_metadata): flags
// kept on the TensorImpl, so they travel with views, detach() and torch.save/torch.load,
// which pickle them beside the data. clone() gives each copy its own map.
struct NeuronMeta final : c10::BackendMeta {
  std::unordered_map<std::string, bool> flags;
  c10::intrusive_ptr<c10::BackendMeta> clone(const c10::intrusive_ptr<c10::BackendMeta>&) const override {
    auto copy = c10::make_intrusive<NeuronMeta>();
    copy->flags = flags;
    return copy;
  }
};

void meta_get(const at::Tensor& t, std::unordered_map<std::string, bool>& out) {
  auto* m = dynamic_cast<NeuronMeta*>(t.unsafeGetTensorImpl()->get_backend_meta());
  if (m) out.insert(m->flags.begin(), m->flags.end());
}

void meta_set(const at::Tensor& t, std::unordered_map<std::string, bool>& in) {
  if (in.empty()) return;
  auto* impl = t.unsafeGetTensorImpl();
  auto* m = dynamic_cast<NeuronMeta*>(impl->get_backend_meta());
  if (!m) {
    auto fresh = c10::make_intrusive<NeuronMeta>();
    m = fresh.get();
    impl->set_backend_meta(fresh);
  }
  for (auto& [k, v] : in) m->flags[k] = v;
}

bool g_meta_registered = [] {
  torch::jit::GetBackendMetaSerialization()[static_cast<size_t>(c10::DeviceType::PrivateUse1)] =
      std::make_pair(torch::jit::BackendMetaPtr(&meta_get), torch::jit::BackendMetaPtr(&meta_set));
  return true;
}();

}  // namespace

void init_memory_history(pybind11::module& m);  // memory_history.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  neuron::check::set_where(&python_where);
  neuron::queue::set_site_hooks(&capture_site, &describe_site);
  m.def("_set_launch_blocking", &neuron::queue::set_blocking,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_launch_blocking", &neuron::queue::blocking);
  m.def("_set_device_threads", &neuron::queue::set_device_threads,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_device_threads", &neuron::queue::device_threads);
  m.def("_enter_compiled", &neuron::queue::enter_compiled);
  m.def("_exit_compiled", &neuron::queue::exit_compiled);
  m.def("_synchronize_all", &neuron::queue::synchronize_all,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_enter_sync", &neuron::queue::enter_sync, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_exit_sync", &neuron::queue::exit_sync);
  m.def("_adaptive_eager_enabled", &neuron::fusion::enabled);
  m.def("_set_adaptive_eager", &neuron::fusion::set_enabled,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_adaptive_eager_stats", [](bool reset) {
    auto s = neuron::fusion::stats(reset);
    return std::make_tuple(s.ops, s.kernels, s.fused_kernels, s.fused_ops, s.one_pass_ops);
  }, pybind11::arg("reset") = false);
  m.def("_sync_op_counts", &neuron::sync_op_counts, pybind11::arg("reset") = false);
  m.def("_queue_counts", [](int d) { return neuron::queue::counts(static_cast<c10::DeviceIndex>(d)); });
  m.def("_set_stream_check", &neuron::check::set_enabled);
  m.def("_stream_check_enabled", &neuron::check::enabled);
  m.def("_set_device_count", &neuron::set_device_count);
  m.def("_device_count", [] { return int(neuron::device_count()); });
  m.def("_current_device", [] { return int(neuron::current_device()); });
  m.def("_set_device", [](int d) { neuron::set_current_device(static_cast<c10::DeviceIndex>(d)); });
  m.def("_set_memory_limit", [](int d, int64_t bytes) {
    neuron::set_memory_limit(static_cast<c10::DeviceIndex>(d), bytes);
  });
  init_memory_history(m);
  m.def("_default_generator", [](int d) {
    return pybind11::reinterpret_steal<pybind11::object>(
        THPGenerator_initDefaultGenerator(neuron::default_generator(static_cast<c10::DeviceIndex>(d))));
  });
  // A CPU tensor over the same memory (device memory is host memory): for transports
  // such as gloo that read and write host buffers. It keeps the device storage alive.
  m.def("_cpu_alias", [](const at::Tensor& t) {
    TORCH_CHECK(t.device().type() == neuron::kDevice, "_cpu_alias expects a neuron tensor, got ", t.device());
    // The caller reads or writes the memory directly: queued work on it must be done.
    {
      pybind11::gil_scoped_release no_gil;
      neuron::queue::synchronize_all();
    }
    auto alias = neuron::cpu_alias(t);
    auto keep = t.storage();
    auto* st = alias.storage().unsafeGetStorageImpl();
    void* p = st->mutable_data();
    st->set_data_ptr_noswap(c10::DataPtr(p, new c10::Storage(keep),
        [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, c10::Device(c10::kCPU)));
    return alias;
  });
  m.def("_scaled_mm_sequential", &neuron::scaled_mm_sequential,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_scaled_blocked_mm_entry", &neuron::scaled_blocked_mm_entry);
  m.def("_grouped_mm_entry", &neuron::grouped_mm_entry);
  // A tensor's TensorImpl and its dtype's ScalarType, as words for a launched kernel that
  // rebuilds the tensor (grouped_mm.cpp); the launch keeps the tensor alive.
  m.def("_tensor_impl", [](const at::Tensor& t) {
    return std::make_pair(reinterpret_cast<int64_t>(t.unsafeGetTensorImpl()),
                          static_cast<int64_t>(t.scalar_type()));
  });
  m.def("_route_composites_to_cpu", &neuron::route_composites_to_cpu);
  m.def("_route_to_queue", &neuron::route_to_queue, pybind11::arg("qualified"));
  // torch.multiprocessing: a device buffer moves into a shared-memory CPU storage (device
  // memory is host memory), which another process maps and adopts as its own device buffer.
  m.def("_shared_cpu_storage", [](const at::Tensor& t) -> std::optional<at::Tensor> {
    auto st = neuron::adopted_storage(t.storage().data_ptr());
    if (!st) return std::nullopt;
    return at::empty({0}, at::kByte).set_(st);
  });
  m.def("_move_to_shared", [](const at::Tensor& t, const at::Tensor& shm) {
    TORCH_CHECK(t.device().type() == neuron::kDevice, "_move_to_shared expects a neuron tensor");
    auto* impl = t.storage().unsafeGetStorageImpl();
    TORCH_CHECK(shm.storage().nbytes() == impl->nbytes(), "_move_to_shared: size mismatch");
    {
      pybind11::gil_scoped_release no_gil;
      neuron::queue::synchronize_all();
    }
    if (impl->nbytes()) std::memcpy(shm.storage().mutable_data(), impl->data(), impl->nbytes());
    impl->set_data_ptr_noswap(neuron::adopt(shm.storage(), t.device().index()));
  });
  m.def("_adopt_tensor", [](const at::Tensor& cpu, int d) {
    return neuron::adopt_tensor(cpu, static_cast<c10::DeviceIndex>(d));
  });
  // Called at interpreter exit (atexit), while Python is alive: autograd's worker threads for
  // this device then leave cleanly instead of being torn down during finalization, where
  // re-acquiring the GIL aborts the process ("terminate called without an active exception").
  m.def("_stop_autograd_workers", [] {
    pybind11::gil_scoped_release no_gil;
    torch::autograd::Engine::get_default_engine().stop();
  });
  m.def("_set_capturing", &neuron::set_capturing);
  m.def("_is_capturing", &neuron::is_capturing);
  m.def("_set_quiet", &neuron::set_quiet);
  m.def("_set_op_records", &neuron::set_recording);
  m.def("_op_records", &neuron::recording);
  // Launches the device's Adaptive Eager window now, without waiting for it: a kernel that
  // charges its own modelled time closes it before and after its ops, so that exactly its
  // ops run unrecorded (synchronize would also block and end a timeline epoch).
  m.def("_close_window", [](int d) {
    pybind11::gil_scoped_release no_gil;
    neuron::queue::close_window(static_cast<c10::DeviceIndex>(d));
  });
  m.def("_quiet", &neuron::quiet);
  m.def("_drain_op_records", &neuron::drain_records);
  // _launch_kernel(entry, name, kinds, *args): a compiled graph's C++ kernel on the queue
  // (csrc/aten/compiled.cpp); entry is the kernel's address, args tensors and ints; kind 'h'
  // is no argument but the work's weight in bytes (launch_kernel's work_bytes).
  m.def("_launch_kernel", [](pybind11::args args) {
    TORCH_CHECK(args.size() >= 3, "_launch_kernel(entry, name, kinds, *args)");
    auto* fn = reinterpret_cast<void*>(args[0].cast<uintptr_t>());
    auto name = args[1].cast<std::string>();
    auto kinds = args[2].cast<std::string>();
    const size_t n = args.size() - 3;
    TORCH_CHECK(kinds.size() == n, "compiled kernel ", name, ": ", kinds.size(),
                " argument kinds for ", n, " arguments");
    std::vector<at::Tensor> tensors;
    std::vector<int64_t> words;
    int64_t work_bytes = 0;
    tensors.reserve(n);
    words.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* a = args[i + 3].ptr();
      if (kinds[i] == 'h') {
        work_bytes += args[i + 3].cast<int64_t>();
        continue;
      }
      if (kinds[i] == 'i') {
        words.push_back(args[i + 3].cast<int64_t>());
        continue;
      }
      TORCH_CHECK(THPVariable_Check(a), "compiled kernel ", name, ": argument ", i,
                  " should be a tensor");
      const at::Tensor& t = THPVariable_Unpack(a);
      words.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
      tensors.push_back(t);
    }
    pybind11::gil_scoped_release no_gil;
    neuron::compiled::launch_kernel(fn, name, kinds, std::move(tensors), std::move(words), work_bytes);
  });
  m.def("_set_dtype_policy", [](pybind11::object policy) {
    Py_XDECREF(g_retry_policy);
    g_retry_policy = policy.inc_ref().ptr();
    neuron::set_dtype_retry(&dtype_retry);
  });
  m.def("_set_dtype_policy_ahead", [](pybind11::object policy) {
    Py_XDECREF(g_ahead_policy);
    g_ahead_policy = policy.inc_ref().ptr();
    neuron::set_dtype_ahead(&dtype_ahead);
  });
  m.def("_add_dtype_policy_op", &neuron::add_dtype_policy_op);
  m.def("_set_stochastic_rounding_hooks", [](pybind11::object op, pybind11::object copy) {
    Py_XDECREF(g_sr_op);
    Py_XDECREF(g_sr_copy);
    g_sr_op = op.inc_ref().ptr();
    g_sr_copy = copy.inc_ref().ptr();
    neuron::sr::set_hooks(&sr_op, &sr_copy);
  });
  m.def("_set_stochastic_rounding", &neuron::sr::set_enabled);
  m.def("_stochastic_rounding_enabled", &neuron::sr::enabled);
}
