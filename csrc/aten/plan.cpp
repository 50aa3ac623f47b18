// Plans: what the launch path learns of an op from its schema alone (which returns it
// allocates, its out= overload, whether it is pointwise or a row op the fusion window takes).
#include "launch_internal.h"

#include <mutex>
#include <string>
#include <unordered_map>

namespace neuron::launch::detail {

namespace {

std::mutex g_mu;
std::unordered_map<const void*, Plan> g_plans;

bool is_tensor_type(const c10::TypePtr& t) { return t->kind() == c10::TypeKind::TensorType; }
bool is_tensor_list_type(const c10::TypePtr& t) {
  auto l = t->castRaw<c10::ListType>();
  return l && l->getElementType()->kind() == c10::TypeKind::TensorType;
}
bool mentions_generator(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::GeneratorType) return true;
  auto opt = t->castRaw<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

// The out= overload with the functional arguments followed by one `out` per fresh return.
const std::vector<std::string>* overloads_of(const std::string& name) {
  static std::unordered_map<std::string, std::vector<std::string>> overloads;
  if (overloads.empty()) {
    for (const auto& n : c10::Dispatcher::singleton().getAllOpNames()) {
      overloads[n.name].push_back(n.overload_name);
    }
  }
  auto it = overloads.find(name);
  return it == overloads.end() ? nullptr : &it->second;
}

bool is_out_arg(const c10::Argument& a) {
  return a.kwarg_only() && is_tensor_type(a.type()) && a.alias_info() && a.alias_info()->isWrite();
}

std::optional<c10::OperatorHandle> find_out(const c10::OperatorHandle& op, size_t n_out) {
  const auto& s = op.schema();
  const auto* ovs = overloads_of(s.name());
  if (!ovs) return std::nullopt;
  for (const auto& ov : *ovs) {
    if (ov == s.overload_name()) continue;
    auto h = c10::Dispatcher::singleton().findOp({s.name(), ov});
    if (!h) continue;
    const auto& a = h->schema().arguments();
    const auto& f = s.arguments();
    if (a.size() != f.size() + n_out || h->schema().returns().size() != n_out) continue;
    bool same = true;
    for (size_t i = 0; i < f.size() && same; ++i) {
      same = a[i].name() == f[i].name() && a[i].type()->str() == f[i].type()->str();
    }
    for (size_t i = f.size(); i < a.size() && same; ++i) same = is_out_arg(a[i]);
    if (same) return h;
  }
  return std::nullopt;
}

// The per-tensor op a `_foreach_` op applies to each index of its lists (CPU runs it so):
// `_foreach_mul_.Scalar` -> `mul_.Scalar`, `_foreach_addcdiv_.ScalarList` -> `addcdiv_`
// with each index's scalar, `_foreach_sqrt` -> `sqrt.out`.
std::optional<c10::OperatorHandle> find_part(const c10::FunctionSchema& s) {
  const std::string prefix = "aten::_foreach_";
  if (s.name().rfind(prefix, 0) != 0) return std::nullopt;
  const bool functional = !s.returns().empty();
  const std::string name = "aten::" + s.name().substr(prefix.size());
  const auto* ovs = overloads_of(name);
  if (!ovs) return std::nullopt;
  auto element = [](const c10::TypePtr& t) {
    auto l = t->castRaw<c10::ListType>();
    return l ? l->getElementType() : t;
  };
  const auto& f = s.arguments();
  for (const auto& ov : *ovs) {
    auto h = c10::Dispatcher::singleton().findOp({name, ov});
    if (!h) continue;
    const auto& a = h->schema().arguments();
    // Trailing arguments the foreach op lacks must have defaults (`add_`'s alpha).
    size_t n = a.size() - (functional ? 1 : 0);
    if (a.size() < f.size() + (functional ? 1 : 0)) continue;
    bool same = functional ? is_out_arg(a.back()) : bool(a[0].alias_info() && a[0].alias_info()->isWrite());
    for (size_t i = 0; i < f.size() && same; ++i) same = element(f[i].type())->str() == a[i].type()->str();
    for (size_t i = f.size(); i < n && same; ++i) same = a[i].default_value().has_value();
    if (same) return h;
  }
  return std::nullopt;
}

Plan make_plan(const c10::OperatorHandle& op) {
  Plan p;
  const auto& s = op.schema();
  p.cost_flags = s.name().find("attention") != std::string::npos;
  if (s.name().rfind("aten::", 0) != 0) {
    if (!routed_to_queue(s.operator_name()) || !s.returns().empty()) return p;
    for (const auto& a : s.arguments()) {
      if (mentions_generator(a.type())) return p;  // random: draws in program order, now
    }
    p.no_meta = p.has_tensor_input = p.eligible = true;
    return p;
  }
  const bool index = s.name() == "aten::index" && s.overload_name() == "Tensor";
  if ((op.hasTag(at::Tag::dynamic_output_shape) && !index) ||
      op.hasTag(at::Tag::data_dependent_output) || op.hasTag(at::Tag::inplace_view)) {
    return p;
  }
  if (index) {
    for (size_t i = 0; i < s.arguments().size(); ++i) {
      if (s.arguments()[i].name() == "indices") p.int_indices_arg = int(i);
    }
    if (p.int_indices_arg < 0) return p;
  }
  if (op.hasTag(at::Tag::nondeterministic_seeded)) {
    // Random ops draw from the generator in program order: they run now. Attention kernels
    // are tagged so for their dropout; without dropout they are deterministic.
    for (size_t i = 0; i < s.arguments().size(); ++i) {
      if (s.arguments()[i].name() == "dropout_p") p.dropout_arg = int(i);
    }
    if (p.dropout_arg < 0) return p;
  }
  for (const auto& a : s.arguments()) {
    if (mentions_generator(a.type())) return p;
    // An in-place op reads what it writes; only out= arguments are written unread.
    bool out = a.alias_info() && a.alias_info()->isWrite() && a.kwarg_only();
    if (!out && (is_tensor_type(a.type()) || a.type()->str().find("Tensor") != std::string::npos)) {
      p.has_tensor_input = true;
    }
  }
  const auto& rets = s.returns();
  bool lists = false;
  for (size_t j = 0; j < rets.size(); ++j) {
    const auto* alias = rets[j].alias_info();
    if (alias) {
      if (!alias->isWrite() || !is_tensor_type(rets[j].type())) return p;
      int arg = -1;
      for (size_t i = 0; i < s.arguments().size(); ++i) {
        const auto* ai = s.arguments()[i].alias_info();
        if (ai && ai->isWrite() && ai->beforeSets() == alias->beforeSets()) arg = int(i);
      }
      if (arg < 0) return p;
      p.ret_arg.push_back(arg);
    } else if (is_tensor_type(rets[j].type()) || is_tensor_list_type(rets[j].type())) {
      lists = lists || is_tensor_list_type(rets[j].type());
      p.ret_arg.push_back(-1);
      p.fresh.push_back(int(j));
    } else {
      return p;  // a number or a bool: the host needs the data
    }
  }
  if (!p.fresh.empty() && !lists && p.fresh.size() == rets.size()) {
    p.out_op = find_out(op, p.fresh.size());
  }
  if (op.hasTag(at::Tag::pointwise) && rets.size() == 1) {
    int writes = 0;
    for (const auto& a : s.arguments()) writes += a.alias_info() && a.alias_info()->isWrite();
    if (p.fresh.size() == 1 && writes == 0 && p.out_op) {
      p.pointwise = true;
    } else if (p.fresh.empty() && writes == 1 && p.ret_arg[0] >= 0) {
      p.pointwise = true;
      p.inplace_self = p.ret_arg[0];
    }
  }
  // Reductions whose per-row result ATen computes from that row alone, whatever else the
  // tensor holds; and concatenation, a copy.
  static const std::unordered_map<std::string, std::string> row_ops = {
      {"aten::sum", "dim_IntList"}, {"aten::mean", "dim"}, {"aten::amax", ""},
      {"aten::amin", ""}, {"aten::cat", ""}};
  auto r = row_ops.find(s.name());
  if (r != row_ops.end() && r->second == s.overload_name() && p.out_op && p.fresh.size() == 1) {
    p.row_kind = s.name() == "aten::cat" ? Plan::kCat : Plan::kReduction;
    for (size_t i = 0; i < s.arguments().size(); ++i) {
      if (s.arguments()[i].name() == "dim") p.dim_arg = int(i);
    }
    if (p.dim_arg < 0) p.row_kind = Plan::kNone;
  }
  if (auto part = find_part(s)) {
    const auto& ret = s.returns();
    if (ret.empty() || (ret.size() == 1 && is_tensor_list_type(ret[0].type()) && p.fresh.size() == 1)) {
      p.row_kind = Plan::kForeach;
      p.part = part;
    }
  }
  p.eligible = true;
  return p;
}

}  // namespace

const Plan& plan_for(const c10::OperatorHandle& op) {
  const void* k = &op.schema();
  // Plans never move (node-based map, never erased): a per-thread cache needs no lock.
  thread_local std::unordered_map<const void*, const Plan*> mine;
  auto hit = mine.find(k);
  if (hit != mine.end()) return *hit->second;
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_plans.find(k);
  if (it == g_plans.end()) it = g_plans.emplace(k, make_plan(op)).first;
  mine.emplace(k, &it->second);
  return it->second;
}

}  // namespace neuron::launch::detail
