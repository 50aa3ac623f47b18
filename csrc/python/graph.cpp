// torch.accelerator.Graph on neuron: the GraphImplInterface PyTorch creates for the device,
// forwarding every call to the Python recorder (torch_neuronx/neuron/graphs.py), which records
// the ops issued during capture and replays them through the dispatcher.
#include <ATen/core/GraphImplInterface.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <type_traits>
#include <string>

namespace {

namespace py = pybind11;

// Runs fn holding the GIL and turns a Python exception into a c10::Error carrying its message.
// PyGILState rather than pybind11's gil_scoped_acquire: torch's binding released the GIL with
// its own pybind11 copy, whose thread-state bookkeeping ours cannot see; and our
// error_already_set type is not the one torch's binding translates.
template <typename F>
auto with_gil(F&& fn) -> decltype(fn()) {
  PyGILState_STATE st = PyGILState_Ensure();
  std::string error;
  try {
    if constexpr (std::is_void_v<decltype(fn())>) {
      fn();
      PyGILState_Release(st);
      return;
    } else {
      auto r = fn();
      PyGILState_Release(st);
      return r;
    }
  } catch (py::error_already_set& e) {
    error = e.what();
  }
  PyGILState_Release(st);
  TORCH_CHECK(false, error);
}

class NeuronGraphImpl final : public at::GraphImplInterface {
 public:
  explicit NeuronGraphImpl(at::GraphImplArgs args) {
    with_gil([&] {
      auto cls = py::module_::import("torch_neuronx.neuron.graphs").attr("_GraphImpl");
      impl_ = std::make_unique<py::object>(cls(args.keep_graph));
    });
  }
  ~NeuronGraphImpl() override {
    // After interpreter shutdown the object cannot be released; leaking it is harmless then.
    if (!Py_IsInitialized()) {
      (void)impl_.release();
      return;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    impl_.reset();
    PyGILState_Release(st);
  }
  void capture_begin(at::MempoolId_t pool, at::GraphCaptureMode mode) override {
    call("capture_begin", pool.first, pool.second, static_cast<int>(mode));
  }
  void capture_end() override { call("capture_end"); }
  void instantiate() override { call("instantiate"); }
  void replay() override { call("replay"); }
  void reset() override { call("reset"); }
  at::MempoolId_t pool() const override {
    return with_gil([&] {
      auto t = impl_->attr("pool")().cast<py::tuple>();
      return at::MempoolId_t{t[0].cast<at::CaptureId_t>(), t[1].cast<at::CaptureId_t>()};
    });
  }
  void enable_debug_mode() override { call("enable_debug_mode"); }
  void debug_dump(const std::string& path) override { call("debug_dump", path); }

 private:
  // Arguments become Python objects inside, under the GIL: torch's binding calls with the GIL
  // released.
  template <typename... A>
  void call(const char* name, const A&... a) {
    with_gil([&] { impl_->attr(name)(a...); });
  }
  std::unique_ptr<py::object> impl_;
};

// The registry is keyed by c10::DeviceTypeName(PrivateUse1, false), which reads the backend's
// name at lookup time; torch_neuronx renames PrivateUse1 to "neuron" on import, after static
// initialisation, so the key is spelled out.
bool g_graph_registered = [] {
  at::GraphImplRegistry()->Register(
      "NEURON", [](at::GraphImplArgs args) -> std::unique_ptr<at::GraphImplInterface> {
        return std::make_unique<NeuronGraphImpl>(args);
      });
  return true;
}();

}  // namespace
