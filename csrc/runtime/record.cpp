// The op record (see record.h) and the unportable-dtype warning.
#include "record.h"
#include "runtime.h"

#include <mutex>
#include <set>
#include <unordered_map>

namespace neuron {

namespace {

struct RecordKeyHash {
  size_t operator()(const RecordKey& k) const {
    size_t h = std::hash<const void*>()(k.name) ^ (size_t(k.device) << 8) ^ (size_t(k.dtype) << 16) ^
               (size_t(k.stream) << 24) ^ (size_t(k.epoch) << 32);
    for (int i = 0; i < k.len; ++i) h = h * 1000003u ^ std::hash<int64_t>()(k.sig[i]);
    return h;
  }
};
struct RecordValue {
  int64_t count = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
};

std::mutex g_record_mu;
std::unordered_map<RecordKey, RecordValue, RecordKeyHash> g_records;
// Set while printing: tensor printing computes in float64 internally, not the user.
thread_local bool t_quiet = false;
// Set while a Python kernel charges its own modelled time for the ops it runs (FlexAttention
// as NKI-lib's kernel): those ops are not recorded a second time.
thread_local bool t_unrecorded = false;

}  // namespace

void commit(Signature& s, const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
            int64_t bytes_in, int64_t bytes_out) {
  if (t_unrecorded) return;
  s.key.name = name;
  s.key.device = static_cast<int8_t>(d);
  s.key.dtype = static_cast<int8_t>(dtype);
  s.key.stream = current_stream_id(d);
  s.key.epoch = timeline_epoch(d, s.key.stream);
  if (trace::on()) trace::on_record(s.key, bytes_in, bytes_out);
  std::lock_guard<std::mutex> g(g_record_mu);
  auto& v = g_records[s.key];
  v.count += 1;
  v.bytes_in += bytes_in;
  v.bytes_out += bytes_out;
}

int64_t cost_flags(const c10::FunctionSchema& schema, const c10::IValue* args, size_t n) {
  if (schema.name().find("attention") == std::string::npos) return -1;
  int64_t f = 0;
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < n && i < formals.size(); ++i) {
    const std::string& a = formals[i].name();
    const c10::IValue& v = args[i];
    if (a == "is_causal" && v.isBool() && v.toBool()) f |= 1;
    if ((a == "attn_mask" || a == "attn_bias") && v.isTensor() && v.toTensor().defined() &&
        v.toTensor().numel() > 0) f |= 2;
    if (a == "dropout_p" && v.isDouble() && v.toDouble() > 0) f |= 4;
  }
  return f;
}

void record_op(const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
               c10::ArrayRef<at::Tensor> shape_tensors, int64_t bytes_in, int64_t bytes_out,
               int64_t flags) {
  Signature s;
  for (const auto& t : shape_tensors) s.add(t);
  s.flag(flags);
  commit(s, name, d, dtype, bytes_in, bytes_out);
}

void record_fused(c10::DeviceIndex d, c10::ScalarType dtype, int64_t numel, int64_t n_ops,
                  int64_t bytes_in, int64_t bytes_out) {
  Signature s;
  s.key.sig[0] = 2;
  s.key.sig[1] = numel;
  s.key.sig[2] = n_ops;
  s.key.len = 3;
  commit(s, "neuron::fused_pointwise", d, dtype, bytes_in, bytes_out);
}

void set_quiet(bool on) { t_quiet = on; }
bool set_recording(bool on) {
  bool was = !t_unrecorded;
  t_unrecorded = !on;
  return was;
}
bool recording() { return !t_unrecorded; }
bool quiet() { return t_quiet; }


std::vector<std::tuple<std::string, int, int, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       int64_t, int64_t>>
drain_records() {
  std::unordered_map<RecordKey, RecordValue, RecordKeyHash> taken;
  {
    std::lock_guard<std::mutex> g(g_record_mu);
    taken.swap(g_records);
  }
  std::vector<std::tuple<std::string, int, int, std::vector<int64_t>, int64_t, int64_t, int64_t,
                         int64_t, int64_t>> out;
  out.reserve(taken.size());
  for (auto& kv : taken) {
    const auto& k = kv.first;
    out.emplace_back(std::string(k.name), int(k.device), int(k.dtype),
                     std::vector<int64_t>(k.sig.begin(), k.sig.begin() + k.len), kv.second.count,
                     kv.second.bytes_in, kv.second.bytes_out, k.stream, k.epoch);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
namespace {

// Dtypes Trainium has no engine support for: they run here, and warn once per op.
bool unportable(c10::ScalarType t) {
  return t == c10::kDouble || t == c10::kComplexFloat || t == c10::kComplexDouble ||
         t == c10::kComplexHalf;
}

std::mutex g_warn_mu;
std::set<std::pair<const void*, int>> g_warned;

void warn_unportable(const c10::OperatorHandle& op, c10::ScalarType t) {
  if (t_quiet) return;
  auto key = std::make_pair(static_cast<const void*>(&op.operator_name()), int(t));
  {
    std::lock_guard<std::mutex> g(g_warn_mu);
    if (!g_warned.insert(key).second) return;
  }
  TORCH_WARN("neuron: ", op.operator_name(), " ran on ", t,
             ", which Trainium's engines do not support; it runs on the virtual NeuronCore "
             "but will not port to the chip as is (warned once per op and dtype).");
}

}  // namespace

void warn_if_unportable(const c10::OperatorHandle& op, c10::ScalarType t) {
  if (unportable(t)) warn_unportable(op, t);
}

}  // namespace neuron
