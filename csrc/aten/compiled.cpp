// A compiled graph's C++ kernels on the device queue.
//
// Inductor generates each fused kernel as an extern "C" function over raw pointers and
// int64 sizes (device memory is host memory). The compiled graph's Python wrapper hands each
// kernel here instead of calling it: it runs on the current stream's executor, in order with
// the eager work before and after it, and the host returns at once, as with any launch.
#include "aten.h"

#include <array>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>

namespace neuron::compiled {
namespace {

static_assert(sizeof(void*) == sizeof(int64_t), "kernel arguments are passed as 64-bit words");

// Pointers and int64 sizes are both 64-bit INTEGER-class arguments (x86-64 SysV, AArch64
// AAPCS), so a kernel taking n of them can be called through a function type of m >= n
// int64 parameters: the callee reads its n, the caller owns and pops the rest.
template <size_t... I>
void call_words(void* fn, const int64_t* a, std::index_sequence<I...>) {
  using Fn = void (*)(decltype((void)I, int64_t{})...);
  reinterpret_cast<Fn>(fn)(a[I]...);
}

template <size_t N>
void call_padded(void* fn, const std::vector<int64_t>& args) {
  std::array<int64_t, N> a{};
  std::copy(args.begin(), args.end(), a.begin());
  call_words(fn, a.data(), std::make_index_sequence<N>{});
}

void call(void* fn, const std::vector<int64_t>& args) {
  const size_t n = args.size();
  if (n <= 8) return call_padded<8>(fn, args);
  if (n <= 32) return call_padded<32>(fn, args);
  if (n <= 128) return call_padded<128>(fn, args);
  return call_padded<kMaxArgs>(fn, args);
}

const char* intern(const std::string& name) {
  static std::mutex mu;
  static std::unordered_set<std::string> names;
  std::lock_guard<std::mutex> lock(mu);
  return names.insert(name).first->c_str();
}

}  // namespace

void launch_kernel(void* fn, const std::string& name, const std::string& kinds,
                   std::vector<at::Tensor> tensors, std::vector<int64_t> words,
                   int64_t work_bytes) {
  TORCH_CHECK(fn != nullptr, "compiled kernel ", name, ": no entry point");
  TORCH_CHECK(words.size() <= kMaxArgs, "compiled kernel ", name, " takes ", words.size(),
              " arguments; the device launches at most ", kMaxArgs);
  c10::DeviceIndex d = -1;
  int64_t bytes = work_bytes;
  std::vector<const void*> reads, writes;
  bool host_operand = false;
  size_t t = 0;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] != 'r' && kinds[i] != 'w') continue;
    const at::Tensor& x = tensors.at(t++);
    if (x.device().type() != kDevice) {
      host_operand = true;  // e.g. an optimizer's step count, a CPU scalar tensor
      continue;
    }
    if (d < 0) d = x.device().index();
    TORCH_CHECK(x.device().index() == d, "compiled kernel ", name, ": arguments on neuron:",
                static_cast<int>(d), " and ", x.device());
    bytes += static_cast<int64_t>(x.nbytes());
    if (check::enabled()) (kinds[i] == 'r' ? reads : writes).push_back(x.storage().data());
  }
  if (host_operand) {
    // Host memory the host may change after the call returns: run now, on this thread,
    // once the device has produced the kernel's device inputs.
    queue::synchronize_all();
    queue::HostThreads threads(bytes);
    call(fn, words);
    return;
  }
  if (d < 0) d = current_device();
  const char* op = intern(name);
  const int64_t stream = current_stream_id(d);
  if (check::enabled()) check::on_op(op, d, reads, writes);
  fusion::count_launch();
  if (!queue::asynchronous() || check::enabled()) {
    // NEURON_LAUNCH_BLOCKING=1, a synchronous region or the stream checker: run it now, as
    // eager ops run then, so that an error is raised by the launch that caused it.
    queue::synchronize(d);
    queue::HostThreads threads(bytes);
    call(fn, words);
    return;
  }
  // The tensors ride along so that their memory outlives the kernel, as an eager op's do.
  queue::launch(d, stream, op,
                [fn, words = std::move(words), tensors = std::move(tensors)] { call(fn, words); },
                bytes);
}

}  // namespace neuron::compiled
