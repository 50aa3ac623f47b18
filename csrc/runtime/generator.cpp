// The device generators. Numbers come from CPU's Mersenne Twister, so a seed gives the same
// numbers as on CPU; the state they show is AWS's: 16 bytes, an 8-byte seed then an 8-byte
// offset. The offset counts the 32-bit words drawn since seeding (CPU draws one per fp32
// element), which is what DTensor's OffsetBasedRNGTracker moves to give each shard its own
// part of one stream. The engine does not count its draws, so the offset is recovered from
// its state by replaying twists from the last position known (checkpoints keep that cheap).
#include "runtime.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace neuron {
namespace {

constexpr int kN = 624, kM = 397;
constexpr uint64_t kMaxTwists = uint64_t(1) << 26;  // 4e10 words: a guard, never a normal case
using MtState = std::array<uint32_t, kN>;

// MT19937's state transition, as ATen's engine applies it before word 1, 625, 1249, ...
void twist(MtState& s) {
  auto mix = [](uint32_t u, uint32_t v) {
    uint32_t y = (u & 0x80000000u) | (v & 0x7fffffffu);
    return (y >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
  };
  int j = 0;
  for (; j < kN - kM; ++j) s[j] = s[j + kM] ^ mix(s[j], s[j + 1]);
  for (; j < kN - 1; ++j) s[j] = s[j + kM - kN] ^ mix(s[j], s[j + 1]);
  s[kN - 1] = s[kM - 1] ^ mix(s[kN - 1], s[0]);
}

MtState seeded(uint64_t seed) { return at::mt19937(seed).data().state_; }

// Positions seen lately, (seed, twists) -> state, so a state saved and restored (checkpointing,
// fork_rng, DTensor regions) is found without replaying the stream from its seed.
struct Checkpoints {
  std::mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, MtState> at;
  std::list<std::pair<uint64_t, uint64_t>> order;
  // Normal samples CPU's generator keeps between calls, by (seed, offset): the 16-byte state
  // has no room for them, so they survive a save/restore within this process only.
  std::map<std::pair<uint64_t, uint64_t>, std::pair<std::optional<float>, std::optional<double>>> normals;

  void put(uint64_t seed, uint64_t t, const MtState& s) {
    std::lock_guard<std::mutex> g(mu);
    auto key = std::make_pair(seed, t);
    if (at.emplace(key, s).second) {
      order.push_back(key);
      if (order.size() > 64) { at.erase(order.front()); order.pop_front(); }
    }
  }
  // The nearest checkpoint of `seed` at or before `t` twists.
  std::optional<std::pair<uint64_t, MtState>> before(uint64_t seed, uint64_t t) {
    std::lock_guard<std::mutex> g(mu);
    auto it = at.upper_bound({seed, t});
    if (it == at.begin()) return std::nullopt;
    --it;
    if (it->first.first != seed) return std::nullopt;
    return std::make_pair(it->first.second, it->second);
  }
};
Checkpoints& checkpoints() {
  static Checkpoints c;
  return c;
}

class NeuronGeneratorImpl : public at::CPUGeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(c10::DeviceIndex d) {
    device_ = c10::Device(kDevice, d);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }

  void set_current_seed(uint64_t seed) override {
    at::CPUGeneratorImpl::set_current_seed(seed);
    known_ = seeded(seed);
    known_twists_ = 0;
  }

  uint64_t get_offset() const override { return words_drawn(); }

  void set_offset(uint64_t offset) override { seek(current_seed(), offset); }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    uint64_t seed = current_seed(), offset = words_drawn();
    auto* self = const_cast<NeuronGeneratorImpl*>(this);
    auto f = self->next_float_normal_sample();
    auto d = self->next_double_normal_sample();
    if (f || d) {
      auto& c = checkpoints();
      std::lock_guard<std::mutex> g(c.mu);
      if (c.normals.size() > 4096) c.normals.clear();
      c.normals[{seed, offset}] = {f, d};
    }
    auto state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr(), &seed, 8);
    std::memcpy(static_cast<uint8_t*>(state.data_ptr()) + 8, &offset, 8);
    return state.getIntrusivePtr();
  }

  void set_state(const c10::TensorImpl& new_state) override {
    TORCH_CHECK_TYPE(new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
                     "RNG state must be a torch.ByteTensor");
    if (new_state.numel() != 16) {
      // CPU's own state (torch.get_rng_state()) is accepted too: it names its seed, and
      // the offset is found from the engine when asked.
      at::CPUGeneratorImpl::set_state(new_state);
      known_ = seeded(current_seed());
      known_twists_ = 0;
      return;
    }
    TORCH_CHECK(new_state.is_contiguous(), "RNG state must be contiguous");
    uint64_t seed, offset;
    const auto* p = static_cast<const uint8_t*>(new_state.data());
    std::memcpy(&seed, p, 8);
    std::memcpy(&offset, p + 8, 8);
    seek(seed, offset);
    auto& c = checkpoints();
    std::lock_guard<std::mutex> g(c.mu);
    auto it = c.normals.find({seed, offset});
    if (it != c.normals.end()) {
      set_next_float_normal_sample(it->second.first);
      set_next_double_normal_sample(it->second.second);
    }
  }

  NeuronGeneratorImpl* clone_impl() const override {
    auto* gen = new NeuronGeneratorImpl(device_.index());
    auto* self = const_cast<NeuronGeneratorImpl*>(this);
    gen->set_engine(self->engine());
    gen->set_next_float_normal_sample(self->next_float_normal_sample());
    gen->set_next_double_normal_sample(self->next_double_normal_sample());
    gen->known_ = known_;
    gen->known_twists_ = known_twists_;
    return gen;
  }

 private:
  // Words drawn since seeding: after t >= 1 twists the engine is at word (t - 1) * 624 + next.
  uint64_t words_drawn() const {
    auto cur = const_cast<NeuronGeneratorImpl*>(this)->engine().data();
    if (cur.next_ == 0) return 0;  // seeded, nothing drawn (the first draw twists)
    uint64_t t = find_twists(cur);
    return (t - 1) * kN + cur.next_;
  }

  uint64_t find_twists(const at::mt19937_data_pod& cur) const {
    if (known_twists_ == 0 && known_ != seeded(cur.seed_)) known_ = seeded(cur.seed_);
    for (int attempt = 0; attempt < 2; ++attempt) {
      MtState s = known_;
      for (uint64_t t = known_twists_; t <= known_twists_ + kMaxTwists; ++t) {
        if (t > 0 && s == cur.state_) {
          known_ = s;
          known_twists_ = t;
          checkpoints().put(cur.seed_, t, s);
          return t;
        }
        twist(s);
      }
      // Not ahead of the last known position (another generator's engine was copied in):
      // start again from the seed.
      known_ = seeded(cur.seed_);
      known_twists_ = 0;
    }
    TORCH_CHECK(false, "neuron generator: the engine's state is not within ", kMaxTwists,
                " twists of its seed ", cur.seed_, ", so its offset can not be given");
  }

  // Put the engine at word `offset` of seed's stream.
  void seek(uint64_t seed, uint64_t offset) {
    at::CPUGeneratorImpl::set_current_seed(seed);  // also drops the cached normal samples
    known_ = seeded(seed);
    known_twists_ = 0;
    if (offset == 0) return;
    uint64_t t = (offset + kN - 1) / kN;
    TORCH_CHECK(t <= kMaxTwists, "neuron generator: offset ", offset, " is beyond ",
                kMaxTwists * kN, " words");
    MtState s = known_;
    uint64_t from = 0;
    if (auto cp = checkpoints().before(seed, t)) std::tie(from, s) = *cp;
    for (; from < t; ++from) twist(s);
    at::mt19937_data_pod pod = at::mt19937(seed).data();
    pod.state_ = s;
    pod.next_ = static_cast<uint32_t>(offset - (t - 1) * kN);
    pod.left_ = kN + 1 - static_cast<int>(pod.next_);
    at::mt19937 engine;
    engine.set_data(pod);
    set_engine(engine);
    known_ = s;
    known_twists_ = t;
    checkpoints().put(seed, t, s);
  }

  mutable MtState known_ = seeded(c10::default_rng_seed_val);  // the engine's state after
  mutable uint64_t known_twists_ = 0;                          // this many twists of its seed
};

std::mutex g_gen_mu;
std::deque<at::Generator> g_default_generators;

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex d) {
  if (d < 0) d = current_device();
  check_device(d);
  std::lock_guard<std::mutex> g(g_gen_mu);
  while (static_cast<int>(g_default_generators.size()) <= d) {
    auto gen = at::make_generator<NeuronGeneratorImpl>(
        static_cast<c10::DeviceIndex>(g_default_generators.size()));
    gen.set_current_seed(c10::default_rng_seed_val);
    g_default_generators.push_back(std::move(gen));
  }
  return g_default_generators[d];
}

at::Generator new_generator(c10::DeviceIndex d) {
  if (d < 0) d = current_device();
  return at::make_generator<NeuronGeneratorImpl>(d);
}

}  // namespace neuron
