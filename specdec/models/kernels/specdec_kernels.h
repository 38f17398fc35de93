// The compiled kernel library's interface and the helpers its sources share.
//
// Every function the library exports, declared once: each source includes this header, so a
// definition that differs from its declaration here fails to compile, and
// specdec/models/native.py declares the same functions to ctypes in its SIGNATURES table
// (tests/test_native.py compares the two). native.py builds the library from int4_matmul.cpp,
// w8a32_matmul.cpp, layer_ops.cpp, attention.cpp and stack.cpp, and hashes this header with them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

// One layer's weights and shapes for specdec_stack, set once at load (specdec/models/layer_stack.py's
// StackLayer mirrors it: every field 8 bytes, no padding).
struct StackLayer {
  int64_t format;
  const float* input_norm;  // null: no input norm
  const uint8_t* qkv_w;
  const float* qkv_bias;
  const float* q_norm;
  const float* k_norm;
  int64_t q_norm_size, k_norm_size, qkv_padded, qkv_width, qkv_in;
  int64_t heads, kv_heads, d, rotary;
  int64_t rope_table;  // which of the forward's cos/sin tables, -1: no RoPE
  int64_t query_list;  // which of the forward's query lists (its attention window's)
  const uint8_t* o_w;
  const float* o_bias;
  const float* o_norm;
  const float* post_norm;  // the MLP's input norm
  const uint8_t* gate_up_w;
  const float* gate_up_bias;
  const uint8_t* down_w;
  const float* down_bias;
  const float* down_norm;
  int64_t activation, inter, hidden_padded, gate_up_padded;
  double eps, scale, softcap;
};

extern "C" {
// int4_matmul.cpp: y [M, N] = x [M, K] (quantized per row to int8) times 4-bit weight records.
const char* specdec_int4_isa();
void specdec_int4_linear(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K);

// w8a32_matmul.cpp: y [M, N] = x [M, K] float32 times 8-bit weight group records.
const char* specdec_w8a32_isa();
void specdec_w8a32_linear(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K);

// layer_ops.cpp: a layer's work around its matmuls (`format` 4: int4 records, 8: w8a32).
void specdec_layer_qkv(int64_t format, const float* x, const float* norm_weight, float eps, const uint8_t* w,
                       const float* bias, const float* q_norm, const float* k_norm, int64_t q_norm_size,
                       int64_t k_norm_size, const float* cos, const float* sin, float* qkv, int64_t M, int64_t N,
                       int64_t K, int64_t width, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary);
void specdec_head_qkv(int64_t format, const float* a, const float* a_weight, const float* b, const float* b_weight,
                      float eps, const uint8_t* w, const float* cos, const float* sin, float* qkv, int64_t M, int64_t N,
                      int64_t hidden, int64_t rope_heads, int64_t d);
void specdec_norm_linear(int64_t format, const float* x, const float* norm_weight, float eps, const uint8_t* w,
                         const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t width);
void specdec_layer_mlp(int64_t format, const float* x, const float* attended, const uint8_t* o_w, const float* o_bias,
                       const float* o_norm, const float* norm_weight, float eps, const uint8_t* gate_up_w,
                       const float* gate_up_bias, const uint8_t* down_w, const float* down_bias, const float* down_norm,
                       int64_t activation, float* out, int64_t M, int64_t hidden, int64_t attn_width, int64_t inter,
                       int64_t hidden_padded, int64_t gate_up_padded);

// attention.cpp: each query over exactly its own key slots (kv_format 0: float32, 1: bfloat16, 2: float16).
void specdec_attend(const float* q, const float* k, const float* v, int64_t q_stride, void* keys, void* values,
                    int64_t row_stride, int64_t head_stride, const int64_t* tokens, const int64_t* rows,
                    const int64_t* slots, const int64_t* counts, int64_t slots_stride, int64_t queries, int64_t heads,
                    int64_t kv_heads, int64_t d, float scale, float* out, int64_t kv_format, float softcap);
void specdec_attend_chain(const float* q, const float* k, const float* v, int64_t q_stride, void* keys, void* values,
                          int64_t row_base, int64_t head_stride, const int64_t* list, int64_t committed, int64_t first,
                          int64_t count, int64_t heads, int64_t kv_heads, int64_t d, float scale, float* out,
                          int64_t kv_format, float softcap);

// stack.cpp: every layer of a forward in one call.
void specdec_stack(const StackLayer* layers, int64_t num_layers, float* x, int64_t M, int64_t hidden,
                   const float* cos, const float* sin, int64_t rope_width, void* const* keys, void* const* values,
                   int64_t row_stride, int64_t head_stride, int64_t kv_format, int64_t num_chains,
                   const int64_t* chains, const int64_t* const* chain_slots, const int64_t* const* list_tokens,
                   const int64_t* const* list_rows, const int64_t* const* list_slots,
                   const int64_t* const* list_counts, const int64_t* list_slots_stride, const int64_t* list_queries,
                   const int64_t* hidden_at, float* hidden_out, float* qkv, float* attended, float* out);
}

namespace specdec {

// What each scratch buffer holds: one buffer per name and calling thread, so buffers in use at
// the same time need different names.
enum class ScratchFor {
  kInt4Activations,  // int4_matmul.cpp: the rows quantized to int8, tiled as the kernel reads them
  kInt4GroupSums,    // int4_matmul.cpp: each row's sum of its int8 activations per group of 32
  kInt4RowScales,    // int4_matmul.cpp: each row's activation scale
  kNormedRows,       // layer_ops.cpp, norm_linear: the rows after RMSNorm, the matmul's input
  kProjected,        // layer_ops.cpp, the MLP call: the o and then the down projection's output (padded rows)
  kGateUp,           // layer_ops.cpp, the MLP call: the gate/up projection's output
  kGated,            // layer_ops.cpp, the MLP call: act(gate) * up, the down projection's input
  kHeadInput,        // layer_ops.cpp, specdec_head_qkv: concat(norm(a), norm(b)), the q/k/v matmul's input
  kNormedOutput,     // layer_ops.cpp, add_projected: one row of a projection through the norm on its output
  kQueryWeights,     // attention.cpp, specdec_attend: every query's softmax weights, per head
  kChainWeights,     // attention.cpp, specdec_attend_chain: a job's queries' softmax weights, per head
};

// The helpers below have internal linkage (an anonymous namespace), as when each source defined
// its own: each source gets its own copy, compiled as before, and its own thread-local buffers.
namespace {

// An allocator of 64-byte aligned memory (a cache line). Why: a vector's buffer from malloc is
// 16-byte aligned, so half of the 32-byte loads from it straddle two cache lines, which costs
// Zen 4 a second load: scoring 32 widened keys ran at 32 G fused multiply-adds a second on one
// core from such a buffer against 46-47 G from an aligned one (a scratch measurement).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
using AlignedFloats = std::vector<float, LineAligned<float>>;

// Scratch: n elements of T, kept per calling thread and per ScratchFor name, or, where not `keep`
// (by default past kKeep elements: a long prefill), one allocation freed after the call so that
// memory does not stay grown (not zeroed: a long prefill's megabytes). Why: a fresh vector each
// call zeroed (and, past glibc's mmap threshold, faulted in) megabytes per verify block (measured
// ~4% of a 16-token step). 64-byte aligned either way.
constexpr size_t kKeep = size_t(1) << 22;
template <typename T, ScratchFor use>
class Scratch {
 public:
  explicit Scratch(size_t n) : Scratch(n, n <= kKeep) {}
  Scratch(size_t n, bool keep) {
    thread_local std::vector<T, LineAligned<T>> kept;
    if (!keep) {
      own_.reset(new (std::align_val_t(64)) T[n]);
      data_ = own_.get();
      return;
    }
    if (kept.size() < n) kept.resize(n);
    data_ = kept.data();
  }
  T* get() const { return data_; }

 private:
  struct AlignedDelete {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<T[], AlignedDelete> own_;
  T* data_;
};

}  // namespace
}  // namespace specdec
