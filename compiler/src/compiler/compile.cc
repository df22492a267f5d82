#include "asmem/compiler/compile.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <unordered_map>

#include "asmem/compiler/chunk_cache.h"
#include "asmem/compiler/cluster.h"
#include "asmem/compiler/fingerprint.h"
#include "asmem/compiler/traces.h"
#include "asmem/atomic_file.h"
#include "asmem/dictionary.h"
#include "asmem/error.h"
#include "asmem/model/batch.h"
#include "asmem/model/llama.h"
#include "asmem/model/prompt_layout.h"
#include "asmem/model/tokenizer.h"
#include "asmem/model/weights.h"
#include "asmem/util/progress.h"
#include "asmem/util/text_file.h"
#include "xxhash.h"

namespace asmem {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t hash_bytes(const void* p, size_t n) { return XXH64(p, n, 0); }

// One trace as tokens: the turn (user message and assistant header) and the response
// (ending with the end-of-turn token). Served tokens after the prefix look the same.
struct TraceTokens {
  std::string prompt;
  std::vector<int32_t> turn;
  std::vector<int32_t> response;
  bool generated = false;  // the response was generated (now or by an earlier compile)
  bool reused = false;     // ... by an earlier compile (--update)
  bool captured = false;   // collection data was captured while generating
  bool holdout = false;
};

at::Tensor to_long_tensor(const std::vector<int64_t>& v, int64_t rows, int64_t cols) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).reshape({rows, cols});
}

// ---------------------------------------------------------------------------------------
// Collection: per layer, the pre-RoPE queries and the exact prefix state of every trace
// token (and, for held-out traces, the state over the trace's own tokens).
// ---------------------------------------------------------------------------------------
struct Captured {
  bool keep_own = false;
  // Per layer, chunks in batch order. q: [n, Hq, d] fp32; o: [n, Hq, d] (fp16 for training
  // data, fp32 for held-out); lse: [n, Hq] fp32.
  std::vector<std::vector<at::Tensor>> q, o, lse, own_o, own_lse;
  explicit Captured(int64_t L) : q(L), o(L), lse(L), own_o(L), own_lse(L) {}
};

class CaptureHook : public AttentionHook {
 public:
  CaptureHook(Captured* out, at::Tensor valid, bool half_values)
      : out_(out), valid_(std::move(valid)), half_(half_values) {}
  // Rows [B, T] (bool) of the next forward that are trace tokens.
  void set_valid(at::Tensor valid) { valid_ = std::move(valid); }
  AttnState prefix_state(int64_t layer, const at::Tensor& q_pre, const at::Tensor&,
                         const at::Tensor&, const AttnState& exact) override {
    out_->q[layer].push_back(q_pre.index({valid_}).to(at::kCPU, at::kFloat));
    out_->o[layer].push_back(exact.o.index({valid_}).to(at::kCPU, half_ ? at::kHalf : at::kFloat));
    out_->lse[layer].push_back(exact.lse.index({valid_}).to(at::kCPU, at::kFloat));
    return exact;
  }
  void on_attention(int64_t layer, const AttnState& own, const AttnState&) override {
    if (!out_->keep_own) return;
    out_->own_o[layer].push_back(own.o.index({valid_}).to(at::kCPU, at::kFloat));
    out_->own_lse[layer].push_back(own.lse.index({valid_}).to(at::kCPU, at::kFloat));
  }

 private:
  Captured* out_;
  at::Tensor valid_;
  bool half_;
};

// ---------------------------------------------------------------------------------------
// Response generation: greedy, full prefix in context, batched with left padding.
// ---------------------------------------------------------------------------------------
// Every trace token is the input of exactly one forward: the turn in the batch's first
// forward, each response token (and the final end-of-turn) in the step after it was
// chosen. So the same forwards also capture the collection data: a generated trace needs
// no second pass.
void generate_responses(LlamaModel& model, const std::vector<KVCache>& prefix, std::vector<TraceTokens*>& todo,
                        int64_t max_new, const std::vector<int32_t>& stops, int32_t end_of_turn,
                        int64_t batch, Captured* cap, bool half_values, const char* label) {
  if (todo.empty()) return;
  std::sort(todo.begin(), todo.end(),
            [](const TraceTokens* a, const TraceTokens* b) { return a->turn.size() < b->turn.size(); });
  Progress bar(label, int64_t(todo.size()), "traces");
  int64_t done = 0;
  const at::Device dev = model.device();
  for (size_t b0 = 0; b0 < todo.size(); b0 += size_t(batch)) {
    const size_t b1 = std::min(todo.size(), b0 + size_t(batch));
    const int64_t B = int64_t(b1 - b0);
    std::vector<const std::vector<int32_t>*> seqs;
    int64_t T = 0;
    for (size_t i = b0; i < b1; ++i) {
      seqs.push_back(&todo[i]->turn);
      T = std::max<int64_t>(T, int64_t(todo[i]->turn.size()));
    }
    KVCache cache = model.share_as_prefix(prefix, B, T + max_new + 1);
    at::Tensor toks = pad_left(seqs, T, &cache.start);
    CaptureHook hook(cap, real_token_mask(cache.start, T, dev), half_values);
    ForwardOptions fo;
    fo.hook = &hook;
    fo.last_logits_only = true;
    at::Tensor logits = model.forward(toks, cache, fo);
    std::vector<bool> active(B, true);
    for (int64_t step = 0; step <= max_new; ++step) {
      at::Tensor next = logits.select(1, 0).argmax(-1).to(at::kCPU).contiguous();
      const int64_t* nx = next.data_ptr<int64_t>();
      std::vector<int64_t> feed(B, end_of_turn);
      std::vector<uint8_t> valid(B, 0);
      std::vector<bool> still(B, false);
      bool any = false, more = false;
      for (int64_t b = 0; b < B; ++b) {
        if (!active[b]) continue;
        any = true;
        valid[b] = 1;
        const bool stop = step == max_new ||
                          std::find(stops.begin(), stops.end(), int32_t(nx[b])) != stops.end();
        feed[b] = stop ? end_of_turn : nx[b];
        todo[b0 + b]->response.push_back(int32_t(feed[b]));
        still[b] = !stop;
        more = more || !stop;
      }
      if (!any) break;
      hook.set_valid(at::tensor(valid).reshape({B, 1}).to(dev, at::kBool));
      ForwardOptions step_fo = fo;
      step_fo.logits = more;
      logits = model.forward(to_long_tensor(feed, B, 1), cache, step_fo);
      for (int64_t b = 0; b < B; ++b) active[b] = still[b];
      if (!more) break;
    }
    for (size_t i = b0; i < b1; ++i) todo[i]->generated = todo[i]->captured = true;
    done += B;
    bar.update(done);
  }
  bar.finish();
}

// Runs the traces against the prefix and captures. Returns the number of tokens captured.
int64_t collect(LlamaModel& model, const std::vector<KVCache>& prefix, std::vector<const TraceTokens*> traces,
                Captured* out, int64_t batch, int64_t max_batch_tokens, bool half_values,
                const char* label) {
  std::sort(traces.begin(), traces.end(), [](const TraceTokens* a, const TraceTokens* b) {
    return a->turn.size() + a->response.size() < b->turn.size() + b->response.size();
  });
  int64_t total = 0;
  for (const auto* t : traces) total += int64_t(t->turn.size() + t->response.size());
  Progress bar(label, total, "tok");
  int64_t done = 0;
  size_t i = 0;
  const at::Device dev = model.device();
  while (i < traces.size()) {
    // Grow the batch while it stays within `batch` traces and the token budget.
    size_t j = i;
    int64_t T = 0;
    while (j < traces.size() && int64_t(j - i) < batch) {
      const int64_t len = int64_t(traces[j]->turn.size() + traces[j]->response.size());
      if (j > i && std::max(T, len) * int64_t(j - i + 1) > max_batch_tokens) break;
      T = std::max(T, len);
      ++j;
    }
    std::vector<std::vector<int32_t>> full;
    for (size_t k = i; k < j; ++k) {
      std::vector<int32_t> s = traces[k]->turn;
      s.insert(s.end(), traces[k]->response.begin(), traces[k]->response.end());
      full.push_back(std::move(s));
    }
    std::vector<const std::vector<int32_t>*> seqs;
    for (const auto& s : full) seqs.push_back(&s);
    const int64_t B = int64_t(j - i);
    KVCache cache = model.share_as_prefix(prefix, B, T);
    at::Tensor toks = pad_left(seqs, T, &cache.start);
    CaptureHook hook(out, real_token_mask(cache.start, T, dev), half_values);
    ForwardOptions fo;
    fo.hook = &hook;
    fo.logits = false;
    model.forward(toks, cache, fo);
    for (const auto& s : full) done += int64_t(s.size());
    bar.update(done);
    i = j;
  }
  bar.finish();
  return total;
}

// Chunked vs exact calibration on the same traces: next-token top-1 agreement and mean
// KL(exact || chunked) over every trace token, each mode's forward run teacher-forced.
struct ModeAgreement {
  int64_t tokens = 0, agree = 0;
  double kl_sum = 0.0;
};
ModeAgreement compare_prefix_modes(LlamaModel& model, const std::vector<KVCache>& exact,
                                   const std::vector<KVCache>& chunked,
                                   const std::vector<const TraceTokens*>& traces) {
  ModeAgreement r;
  Progress bar("chunked vs exact", int64_t(traces.size()), "traces");
  for (size_t i = 0; i < traces.size(); ++i) {
    std::vector<int64_t> ids(traces[i]->turn.begin(), traces[i]->turn.end());
    ids.insert(ids.end(), traces[i]->response.begin(), traces[i]->response.end());
    const int64_t T = int64_t(ids.size());
    at::Tensor toks = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    KVCache a = model.share_as_prefix(exact, 1, T), b = model.share_as_prefix(chunked, 1, T);
    at::Tensor la = at::log_softmax(model.forward(toks, a)[0], -1);
    at::Tensor lb = at::log_softmax(model.forward(toks, b)[0], -1);
    r.kl_sum += (la.exp() * (la - lb)).sum().item<double>();
    r.agree += (la.argmax(-1) == lb.argmax(-1)).sum().item<int64_t>();
    r.tokens += T;
    bar.update(int64_t(i + 1));
  }
  bar.finish();
  return r;
}

at::Tensor cat_layer(std::vector<at::Tensor>& chunks) {
  at::Tensor t = at::cat(chunks, 0);
  chunks.clear();
  chunks.shrink_to_fit();
  return t;
}

// ---------------------------------------------------------------------------------------
// Clustering of one (layer, KV group).
// ---------------------------------------------------------------------------------------
struct GroupDict {
  int64_t K = 0, C1 = 0, n_members = 0;
  at::Tensor keys;        // [K, D] fp32, normalized, leaves in hierarchy order
  at::Tensor o;           // [K, G, d] fp32
  at::Tensor lse;         // [K, G] fp32
  at::Tensor parent_keys; // [C1, D] fp32
  at::Tensor offsets;     // [C1 + 1] int32
  bool whitened = false;
  at::Tensor white_mat, white_mean;  // [R, D] (R = D, or the key rank), [D]
};

at::Tensor from_vec(const std::vector<float>& v, std::vector<int64_t> shape) {
  return at::tensor(v, at::TensorOptions().dtype(at::kFloat)).reshape(shape);
}

// Prepares lookup keys [N, D]: whiten (when given) and normalize. A whitening of fewer rows
// than D (a key rank) projects the keys onto them ([N, R], in double as the runtime's
// reference does).
void prepare_keys(at::Tensor& keys, const Whitening* w) {
  keys = keys.contiguous();
  if (w && int64_t(w->matrix.size()) < w->dim * w->dim) {
    const int64_t R = int64_t(w->matrix.size()) / w->dim;
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor W = at::tensor(std::vector<double>(w->matrix.begin(), w->matrix.end()), f64).reshape({R, w->dim});
    const at::Tensor mean = at::tensor(std::vector<double>(w->mean.begin(), w->mean.end()), f64);
    keys = at::mm(keys.to(at::kDouble) - mean, W.t()).to(at::kFloat).contiguous();
  } else if (w) {
    apply_whitening(*w, keys.data_ptr<float>(), keys.size(0));
  }
  normalize_rows(keys.data_ptr<float>(), keys.size(0), keys.size(1));
}

GroupDict build_group(const at::Tensor& raw_keys, const at::Tensor& o, const at::Tensor& lse,
                      int64_t K, int64_t C1_req, bool whiten, int64_t key_rank, const KMeansParams& base) {
  GroupDict g;
  const int64_t N = raw_keys.size(0), GD = raw_keys.size(1);
  at::Tensor keys = raw_keys.contiguous().clone();
  Whitening wh;
  if (key_rank > 0) {  // the projection onto the top key_rank directions, mean 0
    wh.dim = GD;
    wh.matrix = estimate_key_projection(keys.data_ptr<float>(), N, GD, key_rank);
    wh.mean.assign(size_t(GD), 0.f);
    whiten = true;
  } else if (whiten) {
    wh = estimate_whitening(keys.data_ptr<float>(), N, GD);
  }
  if (whiten) {
    g.whitened = true;
    g.white_mat = from_vec(wh.matrix, {int64_t(wh.matrix.size()) / GD, GD});
    g.white_mean = from_vec(wh.mean, {GD});
  }
  prepare_keys(keys, whiten ? &wh : nullptr);
  const int64_t D = keys.size(1);  // the lookup key dims
  KMeansParams p = base;
  p.k = K;
  KMeansResult km = kmeans(keys.data_ptr<float>(), N, D, p);
  g.K = km.k;
  g.n_members = N;
  const int64_t G = o.size(1), d = o.size(2);
  at::Tensor of = o.to(at::kFloat).contiguous(), lf = lse.to(at::kFloat).contiguous();
  std::vector<float> c_o(g.K * G * d), c_lse(g.K * G), c_keys(g.K * D);
  centroid_states(of.data_ptr<float>(), lf.data_ptr<float>(), km.assign.data(), N, G, d, g.K,
                  c_o.data(), c_lse.data());
  centroid_keys(keys.data_ptr<float>(), km.assign.data(), N, D, g.K, km.centroids.data(),
                c_keys.data());
  const int64_t C1 = std::min<int64_t>(g.K, C1_req > 0 ? C1_req : default_parents(g.K));
  Hierarchy h = build_hierarchy(c_keys.data(), g.K, D, C1, p);
  g.C1 = h.n_parents;
  at::Tensor order = at::tensor(std::vector<int64_t>(h.order.begin(), h.order.end()),
                                at::TensorOptions().dtype(at::kLong));
  g.keys = from_vec(c_keys, {g.K, D}).index_select(0, order).contiguous();
  g.o = from_vec(c_o, {g.K, G, d}).index_select(0, order).contiguous();
  g.lse = from_vec(c_lse, {g.K, G}).index_select(0, order).contiguous();
  g.parent_keys = from_vec(h.parent_keys, {g.C1, D});
  g.offsets = at::tensor(h.offsets, at::TensorOptions().dtype(at::kInt));
  return g;
}

at::ScalarType value_scalar_type(DType t) {
  switch (t) {
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
    default: return at::kFloat;
  }
}

// ---------------------------------------------------------------------------------------
// Held-out evaluation.
// ---------------------------------------------------------------------------------------
struct LayerHoldout {
  at::Tensor q;        // [H, Hq, d]
  at::Tensor exact;    // [H, Hq, d] merged exact output
  AttnState prefix;    // exact prefix state [H, Hq, d] / [H, Hq]
  AttnState own;       // own state
};

// Squared error and squared norm of `est` vs `ref` summed over all elements.
std::pair<double, double> sq_err(const at::Tensor& est, const at::Tensor& ref) {
  return {(est - ref).pow(2).sum().item<double>(), ref.pow(2).sum().item<double>()};
}

// State [H, 1, Hq, d] as AttnState with T = 1 for merge_states.
AttnState as_state(const at::Tensor& o, const at::Tensor& lse) {
  return {o.unsqueeze(1).contiguous(), lse.unsqueeze(1).contiguous()};
}

struct EvalResult {
  double err_linear = 0, err_hier = 0, norm = 0;
  int64_t agree = 0, lookups = 0;
};

// Evaluates one group's dictionary (already dtype-rounded tensors) on held-out keys.
// keys_raw [H, D]; returns per-head prefix estimate (linear and hierarchical).
void lookup_group(const GroupDict& g, const at::Tensor& keys_raw, int64_t top_m,
                  at::Tensor* o_lin, at::Tensor* lse_lin, at::Tensor* o_hier, at::Tensor* lse_hier,
                  int64_t* agree) {
  at::Tensor q = keys_raw.contiguous().clone();
  Whitening wh;
  if (g.whitened) {
    wh.dim = q.size(1);
    wh.matrix.assign(g.white_mat.data_ptr<float>(), g.white_mat.data_ptr<float>() + g.white_mat.numel());
    wh.mean.assign(g.white_mean.data_ptr<float>(), g.white_mean.data_ptr<float>() + g.white_mean.numel());
  }
  prepare_keys(q, g.whitened ? &wh : nullptr);
  at::Tensor scores = at::matmul(q, g.keys.t());          // [H, K]
  at::Tensor lin = scores.argmax(1);                        // first max on ties
  // Hierarchical: the same scores restricted to the children of the top-m parents.
  at::Tensor pscores = at::matmul(q, g.parent_keys.t());  // [H, C1]
  const int64_t m = std::min<int64_t>(top_m, g.C1);
  // The top m parents, ties to the smaller index as the runtime's lookup (a stable sort).
  at::Tensor top = std::get<1>(at::sort(pscores, /*stable=*/true, /*dim=*/1, /*descending=*/true)).narrow(1, 0, m);
  at::Tensor chosen = at::zeros({q.size(0), g.C1}, at::TensorOptions().dtype(at::kBool));
  chosen.scatter_(1, top, true);
  std::vector<int64_t> leaf_parent(g.K);
  const int32_t* off = g.offsets.data_ptr<int32_t>();
  for (int64_t p = 0; p < g.C1; ++p)
    for (int32_t k = off[p]; k < off[p + 1]; ++k) leaf_parent[k] = p;
  at::Tensor lp = at::tensor(leaf_parent, at::TensorOptions().dtype(at::kLong));
  at::Tensor mask = chosen.index_select(1, lp);             // [H, K]
  at::Tensor hier = scores.masked_fill(~mask, -INFINITY).argmax(1);
  *agree += (hier == lin).sum().item<int64_t>();
  *o_lin = g.o.index_select(0, lin);
  *lse_lin = g.lse.index_select(0, lin);
  *o_hier = g.o.index_select(0, hier);
  *lse_hier = g.lse.index_select(0, hier);
}

std::string fmt(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", x);
  return b;
}

// How a compile lays out the traces' turns and ends a response: "chatml" / "llama3" (chat)
// or "raw", then the end-of-turn token id. A stored response is reused only under the same
// layout: a raw compile's responses are text continuations ending in EOS, a chat compile's
// are assistant turns.
std::string layout_key(const PromptLayout& layout, int32_t eot) {
  const char* name = !layout.chat ? "raw" : layout.format == ChatFormat::kLlama3 ? "llama3" : "chatml";
  return std::string(name) + " " + std::to_string(eot);
}

// The responses an earlier compile generated (OLD.asmd.responses.jsonl, one JSON object per
// line: prompt, response, response_ids, model, max_response_tokens, layout), keyed by prompt:
// those of this model (`model_key`), this --max-response-tokens and this layout (`layout`,
// layout_key; a line without one, from before it was stored, is not reused). A missing file
// holds none; a line that is not such an object, or whose ids lie outside [0, vocab), throws
// FormatError "FILE:LINE: ...".
std::unordered_map<std::string, std::vector<int32_t>> read_stored_responses(const std::string& path,
                                                                            const std::string& model_key,
                                                                            int64_t max_response_tokens,
                                                                            const std::string& layout,
                                                                            int64_t vocab) {
  std::unordered_map<std::string, std::vector<int32_t>> out;
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (st.type() == std::filesystem::file_type::not_found) return out;
  if (st.type() != std::filesystem::file_type::regular) {
    throw IoError(path + ": the stored responses of the dictionary to update are not a regular file");
  }
  std::ifstream in(path);
  if (!in) throw IoError(path + ": cannot read the stored responses of the dictionary to update");
  std::string line;
  int64_t line_no = 0;
  while (in && std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto bad = [&](const std::string& what) {
      return FormatError(path + ":" + std::to_string(line_no) + ": " + what + " (a stored response of an earlier compile)");
    };
    if (const std::string why = json_text_problem(line); !why.empty()) throw bad(why);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) throw bad("not valid JSON");
    if (!j.is_object()) throw bad("not a JSON object");
    const auto model = j.find("model"), max_tok = j.find("max_response_tokens");
    if (model == j.end() || !model->is_string()) throw bad("\"model\" is missing or not a string");
    if (max_tok == j.end() || !max_tok->is_number_integer()) {
      throw bad("\"max_response_tokens\" is missing or not an integer");
    }
    if (model->get<std::string>() != model_key || max_tok->get<int64_t>() != max_response_tokens) continue;
    const auto lay = j.find("layout");
    if (lay != j.end() && !lay->is_string()) throw bad("\"layout\" is not a string");
    if (lay == j.end() || lay->get<std::string>() != layout) continue;
    const auto prompt = j.find("prompt"), ids = j.find("response_ids");
    if (prompt == j.end() || !prompt->is_string()) throw bad("\"prompt\" is missing or not a string");
    if (ids == j.end() || !ids->is_array() || ids->empty()) throw bad("\"response_ids\" is missing or not a non-empty array");
    if (int64_t(ids->size()) > max_response_tokens + 1) {
      throw bad("\"response_ids\" holds " + std::to_string(ids->size()) + " tokens, more than --max-response-tokens + 1");
    }
    std::vector<int32_t> v;
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
        throw bad("\"response_ids\" holds " +
                  QuotedText(id.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), 80) +
                  ", not a token id of the model (vocabulary " +
                  std::to_string(vocab) + ")");
      }
      v.push_back(int32_t(id.get<int64_t>()));
    }
    out[prompt->get<std::string>()] = std::move(v);
  }
  return out;
}

}  // namespace

void compile_dictionary(const CompileOptions& opt) {
  const auto t_all = Clock::now();
  nlohmann::json timings = nlohmann::json::object();
  if (opt.entries <= 0 || opt.entries > (int64_t(1) << 24)) {
    throw InvalidArgument("--entries must be in [1, 2^24], got " + std::to_string(opt.entries));
  }
  if (!(opt.holdout >= 0.0 && opt.holdout < 1.0)) throw InvalidArgument("--holdout must be in [0, 1)");
  if (opt.max_response_tokens <= 0) throw InvalidArgument("--max-response-tokens must be positive");
  if (opt.batch <= 0) throw InvalidArgument("--batch must be positive");
  if (opt.prefix_path.empty() == opt.prefix_tokens_path.empty()) {
    throw InvalidArgument("give exactly one of --prefix and --prefix-tokens");
  }
  if (opt.out_path.empty()) throw InvalidArgument("--out is required");
  // The three outputs, before the model and the traces' generation.
  for (const auto& [path, what] : {std::pair<std::string, const char*>{opt.out_path, "--out"},
                                   {opt.out_path + ".report.json", "--out's report"},
                                   {opt.out_path + ".responses.jsonl", "--out's stored responses"}}) {
    check_output_path(path, what);
    check_not_an_input(path, what, {{"--prefix", opt.prefix_path}, {"--prefix-tokens", opt.prefix_tokens_path},
                                    {"--traces", opt.traces_path}, {"--model", opt.model_path}});
  }
  const DType vdtype = parse_value_dtype(opt.value_dtype);
  if (opt.key_mode != "pre_rope" && opt.key_mode != "rope_unified") {
    throw InvalidArgument("--key-mode must be pre_rope or rope_unified, got '" + opt.key_mode + "'");
  }
  // Settings of the later stages, checked here: the clustering starts after minutes of
  // generation on a real prefix.
  if (opt.top_m < 1) throw InvalidArgument("--top-m must be >= 1, got " + std::to_string(opt.top_m));
  if (opt.parents < 0) {
    throw InvalidArgument("--parents must be >= 0 (0: round(sqrt(K))), got " + std::to_string(opt.parents));
  }
  if (opt.kmeans_iters < 0 || opt.kmeans_iters > 100000) {
    throw InvalidArgument("--kmeans-iters must be in [0, 100000], got " + std::to_string(opt.kmeans_iters));
  }
  if (opt.kmeans_backend != "auto" && opt.kmeans_backend != "cpu" && opt.kmeans_backend != "cuda" &&
      opt.kmeans_backend != "reference") {
    throw InvalidArgument("--kmeans-backend must be auto, cpu, cuda or reference, got '" + opt.kmeans_backend + "'");
  }
  if (opt.kmeans_backend == "cuda" && !kmeans_backend_available("cuda")) {
    throw UnsupportedError("--kmeans-backend cuda: this build has no CUDA k-means or no CUDA device is visible");
  }
  if (opt.key_rank < 0 || (opt.key_rank > 0 && !DecodeKeyDimSupported(opt.key_rank))) {
    throw InvalidArgument("--key-rank must be 0 or a multiple of 64 up to 512 (of 128 up to 1024), got " +
                          std::to_string(opt.key_rank));
  }
  if (opt.key_rank > 0 && opt.whitening) throw InvalidArgument("--key-rank and --whitening exclude each other");
  if (opt.rope_position < -1) {
    throw InvalidArgument("--rope-position must be >= 0 (or -1: the prefix length P), got " +
                          std::to_string(opt.rope_position));
  }
  for (int64_t k : opt.report_entries) {
    if (k <= 0) throw InvalidArgument("--report-entries must be positive, got " + std::to_string(k));
  }
  configure_cpu_threads(opt.threads);

  // --- load ------------------------------------------------------------------------------
  auto t0 = Clock::now();
  std::unique_ptr<WeightSource> weights = open_weights(opt.model_path);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_model_path(opt.model_path);
  const at::Device device = parse_device(opt.device);
  LlamaModel model(*weights, device, parse_dtype(opt.model_dtype, device));
  const ModelFingerprint fp = fingerprint_of(*weights);
  const ModelConfig& cfg = model.config();
  const int64_t L = cfg.n_layers, Hq = cfg.n_heads, Hkv = cfg.n_kv_heads, G = cfg.group_size(),
                d = cfg.head_dim, D = G * d;
  if (opt.key_rank >= D) {
    throw InvalidArgument("--key-rank " + std::to_string(opt.key_rank) + " must be below the model's G*d = " +
                          std::to_string(D));
  }
  if (opt.max_response_tokens > cfg.max_context) {
    throw InvalidArgument("--max-response-tokens " + std::to_string(opt.max_response_tokens) +
                          " exceeds the model's context of " + std::to_string(cfg.max_context) + " tokens");
  }
  timings["load_s"] = since(t0);
  std::fprintf(stderr, "compile: model %s (%s) on %s\n", opt.model_path.c_str(), cfg.summary().c_str(),
               device.str().c_str());

  // --- prefix and traces as tokens --------------------------------------------------------
  std::string prefix_text;
  std::vector<int32_t> prefix_ids;
  const bool chat = !opt.raw && opt.prefix_tokens_path.empty();
  const PromptLayout layout = make_prompt_layout(*tok, chat);
  if (!opt.prefix_tokens_path.empty()) {
    prefix_ids = read_token_file(opt.prefix_tokens_path);
    for (int32_t t : prefix_ids) {
      if (t >= cfg.vocab) {
        throw InvalidArgument(opt.prefix_tokens_path + ": token id " + std::to_string(t) +
                              " is outside the model's vocabulary (" + std::to_string(cfg.vocab) + ")");
      }
    }
  } else {
    prefix_text = read_text_file(opt.prefix_path, "prefix");
    if (prefix_text.find_first_not_of(" \t\r\n") == std::string::npos) {
      throw InvalidArgument(opt.prefix_path + ": the prefix is empty or blank");
    }
    prefix_ids = layout_prefix_tokens(*tok, layout, prefix_text);
  }
  const int64_t P = int64_t(prefix_ids.size());
  if (P == 0) {
    throw InvalidArgument((opt.prefix_tokens_path.empty() ? opt.prefix_path : opt.prefix_tokens_path) +
                          ": the prefix has no tokens");
  }
  TraceFileStats tstats;
  std::vector<Trace> traces = read_traces(opt.traces_path, opt.skip_malformed, &tstats, "--skip-malformed");
  if (tstats.skipped) {
    std::fprintf(stderr, "compile: skipped %lld malformed trace lines (first: %s)\n",
                 (long long)tstats.skipped, tstats.first_skip.c_str());
  }
  const int32_t eot = layout_end_of_turn(*tok, layout);
  std::vector<TraceTokens> tt(traces.size());
  int64_t max_trace = 0;
  for (size_t i = 0; i < traces.size(); ++i) {
    tt[i].prompt = traces[i].prompt;
    tt[i].turn = layout_turn_tokens(*tok, layout, traces[i].prompt);
    if (tt[i].turn.empty()) {  // raw text the tokenizer maps to nothing
      throw InvalidArgument(opt.traces_path + ":" + std::to_string(traces[i].line) + ": the prompt has no tokens");
    }
    if (traces[i].response) tt[i].response = layout_response_tokens(*tok, layout, *traces[i].response);
    max_trace = std::max<int64_t>(max_trace, int64_t(tt[i].turn.size()) +
                                                 (traces[i].response ? int64_t(tt[i].response.size())
                                                                     : opt.max_response_tokens + 1));
  }
  if (opt.calib_chunk < 0) throw InvalidArgument("--calib-chunk must be >= 0");
  const bool chunked = opt.calib_chunk > 0 && opt.calib_chunk < P;
  // Trace (and served) tokens start after the prefix, or after the longest chunk.
  const int64_t base = chunked ? opt.calib_chunk : P;
  if (base + max_trace > cfg.max_context) {
    throw InvalidArgument("prefix (" + std::to_string(base) + (chunked ? " tokens per chunk" : " tokens") +
                          ") plus the longest trace (" + std::to_string(max_trace) +
                          ") exceed the model's context of " + std::to_string(cfg.max_context) +
                          " tokens" + (chunked ? "" : "; --calib-chunk N encodes the prefix in chunks"));
  }
  // Deterministic holdout split, by distinct prompt: every trace of a prompt falls on the same
  // side (a repeated prompt gives the same greedy response and queries, so a copy held out
  // beside one trained on scored the dictionary on its own training keys). With distinct
  // prompts this is the split of the traces themselves.
  std::vector<size_t> group(tt.size());  // the trace's prompt, numbered by first appearance
  size_t n_prompts = 0;
  {
    std::unordered_map<std::string, size_t> first;
    for (size_t i = 0; i < tt.size(); ++i) group[i] = first.emplace(tt[i].prompt, first.size()).first->second;
    n_prompts = first.size();
  }
  std::vector<size_t> idx(n_prompts);
  std::iota(idx.begin(), idx.end(), 0);
  std::mt19937_64 rng(opt.seed);
  std::shuffle(idx.begin(), idx.end(), rng);
  const size_t n_hold_prompts = size_t(std::llround(opt.holdout * double(n_prompts)));
  std::vector<char> held(n_prompts, 0);
  for (size_t i = 0; i < n_hold_prompts; ++i) held[idx[i]] = 1;  // holdout < 1: at most n_prompts
  size_t n_hold = 0;
  for (size_t i = 0; i < tt.size(); ++i) {
    tt[i].holdout = held[group[i]] != 0;
    n_hold += tt[i].holdout ? 1 : 0;
  }
  if (n_hold >= tt.size()) {
    throw InvalidArgument("no training traces left after the holdout split (" + std::to_string(n_hold) + " of " +
                          std::to_string(tt.size()) + " traces held out; lower --holdout)");
  }
  std::fprintf(stderr, "compile: prefix %lld tokens; %zu traces of %zu distinct prompts (%zu held out)\n",
               (long long)P, tt.size(), n_prompts, n_hold);

  // The dictionary to update (its responses, and in chunked mode its chunk files).
  std::unique_ptr<DictionaryFile> old;
  const std::string model_key = std::to_string(fp.attn_weights_hash);
  std::unordered_map<std::string, std::vector<int32_t>> reuse;
  if (!opt.update_path.empty()) {
    old = DictionaryFile::open(opt.update_path, /*verify_data=*/false);
    old->check_model(fp);
    reuse = read_stored_responses(opt.update_path + ".responses.jsonl", model_key, opt.max_response_tokens,
                                  layout_key(layout, eot), cfg.vocab);
  }

  // --- prefill ------------------------------------------------------------------------------
  t0 = Clock::now();
  // Exact mode: one part, the whole prefix at 0..P-1. Chunked calibration: parts of
  // calib_chunk tokens, each encoded on its own at positions 0..len-1; each part's KV is
  // kept in OUT.chunks/ and, with --update, taken from OLD.chunks/ when its file holds
  // exactly that part (same tokens, model, dtype, device type and prefill step).
  std::vector<KVCache> prefix;
  std::vector<uint64_t> chunk_hashes;
  const bool use_chunk_files = chunked && opt.chunk_cache;
  const std::string chunk_dir = opt.out_path + ".chunks";
  const std::string old_chunk_dir = old ? opt.update_path + ".chunks" : "";
  ChunkKeyContext chunk_ctx;
  std::vector<std::string> chunk_files;
  std::vector<int64_t> chunks_reused;
  std::vector<std::pair<int64_t, std::string>> chunks_recomputed;  // chunk (1-based), why
  if (use_chunk_files) {
    chunk_ctx.weights_hash = fp.weights_hash;  // weights_hash(*weights), computed by fingerprint_of
    chunk_ctx.dtype = model.dtype() == at::kBFloat16 ? "bf16" : model.dtype() == at::kHalf ? "fp16" : "fp32";
    chunk_ctx.device = device.is_cuda() ? "cuda" : "cpu";
    chunk_ctx.prefill_chunk = opt.chunk;
    std::error_code ec;
    std::filesystem::create_directories(chunk_dir, ec);
    if (ec) throw IoError("cannot create the chunk directory '" + chunk_dir + "': " + ec.message());
  }
  weights.reset();
  {
    Progress bar("prefill", P, "tok");
    const int64_t step = chunked ? opt.calib_chunk : P;
    const std::vector<uint64_t> no_hashes;
    const std::vector<uint64_t>& old_hashes = old ? old->manifest().prefix.chunk_hashes : no_hashes;
    const int64_t old_chunk_tokens = old ? old->manifest().prefix.chunk_tokens : 0;
    for (int64_t s0 = 0; s0 < P; s0 += step) {
      const int64_t n = std::min(step, P - s0);
      const int64_t ci = int64_t(prefix.size());
      const std::vector<int32_t> toks(prefix_ids.begin() + s0, prefix_ids.begin() + s0 + n);
      const uint64_t h = hash_bytes(toks.data(), toks.size() * sizeof(int32_t));
      if (chunked) chunk_hashes.push_back(h);
      std::string name;
      if (use_chunk_files) {
        name = chunk_file_name(toks, chunk_ctx);
        chunk_files.push_back(name);
      }
      if (use_chunk_files && old) {
        KVCache kv;
        std::string why;
        if (read_chunk_kv(old_chunk_dir + "/" + name, toks, chunk_ctx, model, &kv, &why)) {
          prefix.push_back(std::move(kv));
          chunks_reused.push_back(ci + 1);
          if (old_chunk_dir != chunk_dir) write_chunk_kv(chunk_dir + "/" + name, toks, chunk_ctx, model, prefix.back());
          bar.update(s0 + n);
          continue;
        }
        if (why == "no cached file") {
          if (old_chunk_tokens != opt.calib_chunk) {
            why = old_chunk_tokens == 0 ? "the old dictionary is not chunked"
                                        : "chunk size changed (" + std::to_string(old_chunk_tokens) + " -> " +
                                              std::to_string(opt.calib_chunk) + " tokens)";
          } else if (ci >= int64_t(old_hashes.size())) {
            why = "new chunk";
          } else if (old_hashes[ci] != h) {
            why = "tokens changed";
          } else {
            why = "not cached for this model, dtype, device and --chunk";
          }
        }
        chunks_recomputed.emplace_back(ci + 1, why);
      }
      prefix.push_back(model.new_cache(1, n));
      at::Tensor ids = at::tensor(std::vector<int64_t>(toks.begin(), toks.end()),
                                  at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
      ForwardOptions fo;
      fo.logits = false;
      model.prefill(ids, prefix.back(), opt.chunk, fo, [&](int64_t d2, int64_t) { bar.update(s0 + d2); });
      if (use_chunk_files) write_chunk_kv(chunk_dir + "/" + name, toks, chunk_ctx, model, prefix.back());
    }
  }
  if (use_chunk_files && old) {
    // e.g. "update: chunks 1,2,4 reused, chunk 3 recomputed (tokens changed)"
    auto list = [](const std::vector<int64_t>& v) {
      std::string r = v.size() == 1 ? "chunk " : "chunks ";
      for (size_t i = 0; i < v.size(); ++i) r += (i ? "," : "") + std::to_string(v[i]);
      return r;
    };
    std::vector<std::string> parts;
    if (!chunks_reused.empty()) parts.push_back(list(chunks_reused) + " reused");
    std::map<std::string, std::vector<int64_t>> by_reason;
    for (const auto& [c, why] : chunks_recomputed) by_reason[why].push_back(c);
    for (const auto& [why, cs] : by_reason) parts.push_back(list(cs) + " recomputed (" + why + ")");
    std::string line;
    for (size_t i = 0; i < parts.size(); ++i) line += (i ? ", " : "") + parts[i];
    std::fprintf(stderr, "update: %s\n", line.c_str());
  }
  timings["prefill_s"] = since(t0);

  // --- responses: reuse from --update, generate the rest ---------------------------------------
  t0 = Clock::now();
  if (old) {
    const DictionaryManifest& om = old->manifest();
    std::fprintf(stderr, "update: %s: prefix %s (%lld -> %lld tokens); %zu stored responses usable\n",
                 opt.update_path.c_str(),
                 om.prefix.token_hash == hash_bytes(prefix_ids.data(), prefix_ids.size() * 4) ? "unchanged" : "changed",
                 (long long)om.prefix.n_tokens, (long long)P, reuse.size());
  }
  std::vector<TraceTokens*> todo, todo_hold;
  int64_t n_reused = 0;
  for (size_t i = 0; i < tt.size(); ++i) {
    if (traces[i].response) continue;
    auto it = reuse.find(tt[i].prompt);
    if (it != reuse.end()) {
      tt[i].response = it->second;
      tt[i].reused = true;
      tt[i].generated = true;
      ++n_reused;
    } else {
      (tt[i].holdout ? todo_hold : todo).push_back(&tt[i]);
    }
  }
  if (!opt.update_path.empty()) {
    std::fprintf(stderr, "update: reusing %lld generated responses; generating %zu (new or changed prompts); "
                 "recomputing collection and clustering (the prefix states depend on the whole prefix)\n",
                 (long long)n_reused, todo.size() + todo_hold.size());
  }
  // Generation captures the collection data of the traces it writes.
  Captured cap(L), hcap(L);
  hcap.keep_own = true;
  generate_responses(model, prefix, todo, opt.max_response_tokens, tok->stop_ids(), eot, opt.batch,
                     &cap, /*half_values=*/true, "generate");
  generate_responses(model, prefix, todo_hold, opt.max_response_tokens, tok->stop_ids(), eot, opt.batch,
                     &hcap, /*half_values=*/false, "holdout");
  const int64_t n_generated = int64_t(todo.size() + todo_hold.size());
  timings["generate_s"] = since(t0);
  // The stored responses (for a later --update): written beside the report once the
  // dictionary is, so that a compile that fails leaves an existing OUT's files as they were.
  std::string responses_jsonl;
  {
    std::string& side = responses_jsonl;
    for (const auto& t : tt) {
      if (!t.generated) continue;
      std::vector<int32_t> body(t.response.begin(), t.response.end() - 1);
      nlohmann::json j = {{"prompt", t.prompt},
                          {"response", tok->decode(body)},
                          {"response_ids", t.response},
                          {"model", model_key},
                          {"max_response_tokens", opt.max_response_tokens},
                          {"layout", layout_key(layout, eot)}};
      side += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    }
  }

  // --- collect (traces whose responses were given or reused) -------------------------------
  t0 = Clock::now();
  std::vector<const TraceTokens*> train_rest, hold_rest, hold;
  int64_t n_train = 0, n_hold_tok = 0;
  for (const auto& t : tt) {
    const int64_t len = int64_t(t.turn.size() + t.response.size());
    (t.holdout ? n_hold_tok : n_train) += len;
    if (t.holdout) hold.push_back(&t);
    if (!t.captured) (t.holdout ? hold_rest : train_rest).push_back(&t);
  }
  const int64_t max_batch_tokens = 4096;
  if (!train_rest.empty()) collect(model, prefix, train_rest, &cap, opt.batch, max_batch_tokens, true, "collect");
  if (!hold_rest.empty()) collect(model, prefix, hold_rest, &hcap, opt.batch, max_batch_tokens, false, "holdout");
  timings["collect_s"] = since(t0);

  // Chunked calibration, measured against the exact mode where both apply.
  nlohmann::json chunk_report;
  if (chunked && !hold.empty() && P + max_trace <= cfg.max_context) {
    t0 = Clock::now();
    std::vector<KVCache> exact;
    exact.push_back(model.new_cache(1, P));
    at::Tensor ids = at::tensor(std::vector<int64_t>(prefix_ids.begin(), prefix_ids.end()),
                                at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    ForwardOptions fo;
    fo.logits = false;
    model.prefill(ids, exact.back(), opt.chunk, fo);
    const ModeAgreement m = compare_prefix_modes(model, exact, prefix, hold);
    chunk_report = {{"chunks", prefix.size()}, {"chunk_tokens", opt.calib_chunk},
                    {"holdout_tokens", m.tokens},
                    {"top1_agreement_vs_exact", double(m.agree) / double(m.tokens)},
                    {"mean_kl_exact_to_chunked", m.kl_sum / double(m.tokens)}};
    std::fprintf(stderr, "chunked calibration (%zu chunks of <= %lld tokens) vs exact on %lld held-out "
                 "trace tokens: next-token top-1 agreement %.1f%%, mean KL %.4f nats\n",
                 prefix.size(), (long long)opt.calib_chunk, (long long)m.tokens,
                 100.0 * double(m.agree) / double(m.tokens), m.kl_sum / double(m.tokens));
    timings["chunk_compare_s"] = since(t0);
  }

  // --- cluster ------------------------------------------------------------------------------
  t0 = Clock::now();
  KMeansParams kp;
  kp.iters = opt.kmeans_iters;
  kp.seed = opt.seed;
  kp.backend = opt.kmeans_backend == "auto" ? (device.is_cuda() && kmeans_backend_available("cuda") ? "cuda" : "cpu")
                                            : opt.kmeans_backend;
  std::vector<int64_t> eval_k = {opt.entries};
  for (int64_t k : opt.report_entries) {
    if (k > 0 && std::find(eval_k.begin(), eval_k.end(), k) == eval_k.end()) eval_k.push_back(k);
  }
  if (std::find(eval_k.begin(), eval_k.end(), int64_t(1)) == eval_k.end()) eval_k.push_back(1);
  const at::ScalarType vst = value_scalar_type(vdtype);
  // Report accumulators: per K, per layer.
  struct Acc { std::vector<double> lin, hier, norm, none; std::vector<int64_t> agree, n; };
  std::map<int64_t, Acc> acc;
  for (int64_t k : eval_k) acc[k] = Acc{std::vector<double>(L), std::vector<double>(L), std::vector<double>(L),
                                        std::vector<double>(L), std::vector<int64_t>(L), std::vector<int64_t>(L)};
  std::vector<GroupDict> sections;  // the written K, layer-major
  sections.reserve(L * Hkv);
  Progress bar("cluster", L * Hkv * int64_t(eval_k.size()), "groups");
  int64_t groups_done = 0;
  const bool unified = opt.key_mode == "rope_unified";
  const int64_t rope_pos = opt.rope_position >= 0 ? opt.rope_position : P;
  // RoPE-unified keys: every query rotated as if it sat at rope_pos.
  auto lookup_keys = [&](const at::Tensor& q) {
    if (!unified) return q;
    at::Tensor pos = at::full({q.size(0)}, rope_pos, at::TensorOptions().dtype(at::kLong));
    return model.apply_rope(q.to(model.device(), at::kFloat).unsqueeze(0), pos)
        .squeeze(0).to(at::kCPU, at::kFloat).contiguous();
  };
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor q = lookup_keys(cat_layer(cap.q[l]));  // [N, Hq, d]
    at::Tensor o = cat_layer(cap.o[l]);          // [N, Hq, d] fp16
    at::Tensor lse = cat_layer(cap.lse[l]);      // [N, Hq]
    LayerHoldout ho;
    if (n_hold_tok > 0) {
      ho.q = lookup_keys(cat_layer(hcap.q[l]));
      ho.prefix = {cat_layer(hcap.o[l]), cat_layer(hcap.lse[l])};
      ho.own = {cat_layer(hcap.own_o[l]), cat_layer(hcap.own_lse[l])};
      ho.exact = merge_states(as_state(ho.prefix.o, ho.prefix.lse), as_state(ho.own.o, ho.own.lse)).o.squeeze(1);
    }
    for (int64_t k : eval_k) {
      at::Tensor est_lin_o = at::empty({n_hold_tok, Hq, d}), est_lin_l = at::empty({n_hold_tok, Hq});
      at::Tensor est_hier_o = at::empty({n_hold_tok, Hq, d}), est_hier_l = at::empty({n_hold_tok, Hq});
      for (int64_t g = 0; g < Hkv; ++g) {
        at::Tensor keys = q.narrow(1, g * G, G).reshape({-1, D}).contiguous();
        GroupDict gd = build_group(keys, o.narrow(1, g * G, G), lse.narrow(1, g * G, G), k,
                                   opt.parents, opt.whitening, opt.key_rank, kp);
        // Round to the stored dtype so the report sees what the runtime will.
        gd.keys = gd.keys.to(vst).to(at::kFloat);
        gd.o = gd.o.to(vst).to(at::kFloat);
        gd.parent_keys = gd.parent_keys.to(vst).to(at::kFloat);
        if (n_hold_tok > 0) {
          at::Tensor hk = ho.q.narrow(1, g * G, G).reshape({-1, D});
          at::Tensor ol, ll, oh, lh;
          int64_t agree = 0;
          lookup_group(gd, hk, opt.top_m, &ol, &ll, &oh, &lh, &agree);
          est_lin_o.narrow(1, g * G, G).copy_(ol);
          est_lin_l.narrow(1, g * G, G).copy_(ll);
          est_hier_o.narrow(1, g * G, G).copy_(oh);
          est_hier_l.narrow(1, g * G, G).copy_(lh);
          acc[k].agree[l] += agree;
          acc[k].n[l] += n_hold_tok;
        }
        if (k == opt.entries) sections.push_back(std::move(gd));
        bar.update(++groups_done);
      }
      if (n_hold_tok > 0) {
        AttnState own = as_state(ho.own.o, ho.own.lse);
        at::Tensor lin = merge_states(as_state(est_lin_o, est_lin_l), own).o.squeeze(1);
        at::Tensor hier = merge_states(as_state(est_hier_o, est_hier_l), own).o.squeeze(1);
        acc[k].lin[l] = sq_err(lin, ho.exact).first;
        acc[k].hier[l] = sq_err(hier, ho.exact).first;
        auto none = sq_err(ho.own.o, ho.exact);
        acc[k].none[l] = none.first;
        acc[k].norm[l] = none.second;
      }
    }
  }
  bar.finish();
  timings["cluster_s"] = since(t0);

  // --- write ---------------------------------------------------------------------------------
  t0 = Clock::now();
  DictionaryManifest man;
  man.format_version = kDictionaryFormatVersion;
  man.model = fp;
  man.tokenizer_hash = tok->fingerprint();
  man.prefix.n_tokens = P;
  man.prefix.text_hash = prefix_text.empty() ? 0 : hash_bytes(prefix_text.data(), prefix_text.size());
  man.prefix.token_hash = hash_bytes(prefix_ids.data(), prefix_ids.size() * sizeof(int32_t));
  man.prefix.text_preview = prefix_text.substr(0, 200);
  man.prefix.chunk_tokens = chunked ? opt.calib_chunk : 0;
  man.prefix.chunk_hashes = chunk_hashes;
  man.compile.entries = opt.entries;
  man.compile.parents = sections.empty() ? 0 : sections[0].C1;
  man.compile.top_m = opt.top_m;
  man.compile.value_dtype = dtype_name(vdtype);
  man.compile.seed = opt.seed;
  man.compile.kmeans_iters = opt.kmeans_iters;
  man.compile.whitening = opt.whitening || opt.key_rank > 0;
  man.compile.key_rank = opt.key_rank;
  man.compile.key_mode = opt.key_mode;
  man.compile.rope_unified_position = unified ? rope_pos : 0;
  man.compile.n_traces = int64_t(tt.size());
  man.compile.n_train_tokens = n_train;
  man.compile.n_holdout_tokens = n_hold_tok;
  man.compile.max_response_tokens = opt.max_response_tokens;
  man.compile.tool_version = "asmem 0.1.0";
  for (const TraceTokens& t : tt) {
    if (!t.holdout) man.compile.train_prompt_hashes.push_back(prompt_hash(t.prompt));
  }
  std::sort(man.compile.train_prompt_hashes.begin(), man.compile.train_prompt_hashes.end());
  man.compile.train_prompt_hashes.erase(
      std::unique(man.compile.train_prompt_hashes.begin(), man.compile.train_prompt_hashes.end()),
      man.compile.train_prompt_hashes.end());
  nlohmann::json extra = {{"chat_format", chat}, {"raw", opt.raw}};
  man.compile.extra_json = extra.dump();
  // Byte buffers that the section TensorRefs point into.
  std::vector<at::Tensor> keep;
  auto ref = [&](const at::Tensor& t, DType dt) {
    at::Tensor c = t.to(dt == DType::kI32 ? at::kInt : value_scalar_type(dt)).contiguous();
    keep.push_back(c);
    TensorRef r;
    r.dtype = dt;
    r.shape = c.sizes().vec();
    r.data = c.data_ptr();
    r.nbytes = uint64_t(c.nbytes());
    return r;
  };
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t g = 0; g < Hkv; ++g) {
      const GroupDict& gd = sections[l * Hkv + g];
      DictSection s;
      s.layer = int32_t(l);
      s.kv_head = int32_t(g);
      s.group_size = int32_t(G);
      s.head_dim = int32_t(d);
      s.entries = gd.K;
      s.n_parents = gd.C1;
      s.n_members = gd.n_members;
      s.keys = ref(gd.keys, vdtype);
      s.values_o = ref(gd.o, vdtype);
      s.values_lse = ref(gd.lse, DType::kF32);
      s.parent_keys = ref(gd.parent_keys, vdtype);
      s.child_offsets = ref(gd.offsets, DType::kI32);
      if (gd.whitened) {
        s.whitening = ref(gd.white_mat, DType::kF32);
        s.whitening_mean = ref(gd.white_mean, DType::kF32);
      }
      man.sections.push_back(std::move(s));
    }
  }
  write_dictionary(opt.out_path, man);
  if (use_chunk_files) {
    // Chunk files of earlier prefixes that this one no longer has.
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(chunk_dir, ec)) {
      const std::string name = e.path().filename().string();
      if (is_chunk_file_name(name) && std::find(chunk_files.begin(), chunk_files.end(), name) == chunk_files.end()) {
        std::filesystem::remove(e.path(), ec);
      }
    }
  }
  timings["write_s"] = since(t0);
  timings["total_s"] = since(t_all);

  // --- report --------------------------------------------------------------------------------
  nlohmann::json rep;
  rep["dictionary"] = opt.out_path;
  rep["model"] = opt.model_path;
  rep["prefix_tokens"] = P;
  rep["traces"] = tt.size();
  rep["holdout_traces"] = n_hold;
  rep["train_tokens"] = n_train;
  rep["holdout_tokens"] = n_hold_tok;
  rep["generated_responses"] = n_generated;
  rep["reused_responses"] = n_reused;
  if (use_chunk_files && old) {
    nlohmann::json rc = nlohmann::json::array();
    for (const auto& [c, why] : chunks_recomputed) rc.push_back({{"chunk", c}, {"reason", why}});
    rep["update_chunks"] = {{"reused", chunks_reused}, {"recomputed", rc}};
  }
  // Entries the sections hold: K, or fewer where a section's training keys have fewer
  // distinct rows (or k-means left centroids without a point).
  int64_t k_min = INT64_MAX, k_max = 0;
  for (const DictSection& sec : man.sections) {
    k_min = std::min(k_min, sec.entries);
    k_max = std::max(k_max, sec.entries);
  }
  rep["entries"] = opt.entries;
  rep["section_entries"] = {{"min", k_min}, {"max", k_max}};
  if (k_max < opt.entries) {
    std::fprintf(stderr, "compile: warning: --entries %lld, but no section has that many distinct training keys: "
                 "sections hold %lld to %lld entries\n", (long long)opt.entries, (long long)k_min, (long long)k_max);
  }
  rep["value_dtype"] = dtype_name(vdtype);
  rep["kmeans_backend"] = kp.backend;
  rep["timings"] = timings;
  if (!chunk_report.is_null()) rep["chunked_vs_exact"] = chunk_report;
  rep["metric"] = "relative L2 error of the attention output on held-out trace tokens, per layer: "
                  "sqrt(sum |o_est - o_exact|^2 / sum |o_exact|^2), o_exact = exact attention over "
                  "prefix + own tokens, o_est = dictionary prefix state merged with exact own state";
  if (n_hold_tok > 0) {
    nlohmann::json layers = nlohmann::json::array();
    std::fprintf(stderr, "\nheld-out attention-output error (relative L2) per layer, %lld tokens:\n",
                 (long long)n_hold_tok);
    std::string head = "layer  no-prefix      K=1";
    for (int64_t k : eval_k)
      if (k != 1) head += "  K=" + std::to_string(k) + std::string(std::max<int>(1, 7 - int(std::to_string(k).size())), ' ') + "hier";
    std::fprintf(stderr, "%s\n", head.c_str());
    for (int64_t l = 0; l < L; ++l) {
      const double norm = acc[eval_k[0]].norm[l];
      nlohmann::json row = {{"layer", l}, {"no_prefix", std::sqrt(acc[eval_k[0]].none[l] / norm)},
                            {"k1", std::sqrt(acc[1].lin[l] / norm)}};
      std::string line = std::to_string(l);
      line += std::string(7 - line.size(), ' ') + fmt(row["no_prefix"].get<double>()) + "   " +
              fmt(row["k1"].get<double>());
      for (int64_t k : eval_k) {
        if (k == 1) continue;
        const double lin = std::sqrt(acc[k].lin[l] / norm), hier = std::sqrt(acc[k].hier[l] / norm);
        row["k" + std::to_string(k)] = {{"linear", lin}, {"hierarchical", hier},
                                        {"hier_equals_linear", double(acc[k].agree[l]) / double(acc[k].n[l])}};
        line += "   " + fmt(lin) + " " + fmt(hier);
      }
      std::fprintf(stderr, "%s\n", line.c_str());
      layers.push_back(row);
    }
    rep["layers"] = layers;
    nlohmann::json summary = nlohmann::json::object();
    for (int64_t k : eval_k) {
      double sl = 0, sh = 0, sn = 0, sz = 0;
      int64_t ag = 0, n = 0;
      for (int64_t l = 0; l < L; ++l) {
        sl += std::sqrt(acc[k].lin[l] / acc[k].norm[l]);
        sh += std::sqrt(acc[k].hier[l] / acc[k].norm[l]);
        sn += std::sqrt(acc[k].none[l] / acc[k].norm[l]);
        ag += acc[k].agree[l];
        n += acc[k].n[l];
        sz += 1;
      }
      summary["k" + std::to_string(k)] = {{"mean_linear", sl / sz}, {"mean_hierarchical", sh / sz},
                                          {"hier_equals_linear", n ? double(ag) / double(n) : 0.0}};
      if (k == eval_k[0]) summary["no_prefix_mean"] = sn / sz;
    }
    rep["summary"] = summary;
    std::fprintf(stderr, "mean over layers: no-prefix %s, K=1 %s", fmt(summary["no_prefix_mean"].get<double>()).c_str(),
                 fmt(summary["k1"]["mean_linear"].get<double>()).c_str());
    for (int64_t k : eval_k) {
      if (k == 1) continue;
      const auto& s = summary["k" + std::to_string(k)];
      std::fprintf(stderr, ", K=%lld %s (hierarchical %s, same leaf as linear %.1f%%)", (long long)k,
                   fmt(s["mean_linear"].get<double>()).c_str(), fmt(s["mean_hierarchical"].get<double>()).c_str(),
                   100.0 * s["hier_equals_linear"].get<double>());
    }
    std::fprintf(stderr, "\n");
  }
  // The dictionary is in place: a sidecar that cannot be written says so.
  auto write_sidecar = [&](const std::string& path, const std::string& text) {
    try {
      write_file_atomic(path, text);
    } catch (const IoError& e) {
      throw IoError(std::string(e.what()) + " (the dictionary " + opt.out_path + " was written)");
    }
  };
  write_sidecar(opt.out_path + ".responses.jsonl", responses_jsonl);
  write_sidecar(opt.out_path + ".report.json", rep.dump(2) + "\n");
  const std::string k_text = k_min == opt.entries ? "K=" + std::to_string(opt.entries)
                                                   : "K=" + std::to_string(opt.entries) + ", " + std::to_string(k_min) +
                                                         "-" + std::to_string(k_max) + " entries per section";
  std::fprintf(stderr, "\ncompile: wrote %s (%lld x %lld sections, %s) in %s: load %.1fs, prefill %.1fs, "
               "generate %.1fs, collect %.1fs, cluster %.1fs, write %.1fs\n",
               opt.out_path.c_str(), (long long)L, (long long)Hkv, k_text.c_str(),
               format_duration(timings["total_s"].get<double>()).c_str(), timings["load_s"].get<double>(),
               timings["prefill_s"].get<double>(), timings["generate_s"].get<double>(),
               timings["collect_s"].get<double>(), timings["cluster_s"].get<double>(),
               timings["write_s"].get<double>());
}

}  // namespace asmem
