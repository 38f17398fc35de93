// The decoder stack in one call: every layer of a forward whose layers all run compiled (FusedDecoderLayer)
// and whose attention is all compiled (chains over their rows, per-query lists), with no Python between
// layers (specdec/models/layer_stack.py; the layers' StackLayer is in specdec_kernels.h). Each layer makes
// exactly the calls the per-layer path makes, in the same order and on the same buffers' contents, so its
// bits are the per-layer path's.
#include <cstdint>
#include <cstring>

#include "specdec_kernels.h"

extern "C" {
// x [M, hidden] in place: through every layer. cos, sin [tables, M, rope_width]; keys[l], values[l]: layer
// l's cache; chains [num_chains, 4]: (first token, count, committed, row base) with chain_slots[c] the row's
// slots; query list j: tokens, rows, slots (slots_stride apart), counts, queries; hidden_at[l] >= 0: copy
// x after layer l into hidden_out + hidden_at[l] * M * hidden. Scratch: qkv [M, the widest qkv_padded],
// attended [M, the widest heads * d], out [M, hidden].
void specdec_stack(const StackLayer* layers, int64_t num_layers, float* x, int64_t M, int64_t hidden,
                   const float* cos, const float* sin, int64_t rope_width, void* const* keys, void* const* values,
                   int64_t row_stride, int64_t head_stride, int64_t kv_format, int64_t num_chains,
                   const int64_t* chains, const int64_t* const* chain_slots, const int64_t* const* list_tokens,
                   const int64_t* const* list_rows, const int64_t* const* list_slots,
                   const int64_t* const* list_counts, const int64_t* list_slots_stride, const int64_t* list_queries,
                   const int64_t* hidden_at, float* hidden_out, float* qkv, float* attended, float* out) {
  float* current = x;
  float* next = out;
  for (int64_t l = 0; l < num_layers; ++l) {
    const StackLayer& layer = layers[l];
    const float eps = static_cast<float>(layer.eps);
    const float* layer_cos = layer.rope_table < 0 ? nullptr : cos + layer.rope_table * M * rope_width;
    const float* layer_sin = layer.rope_table < 0 ? nullptr : sin + layer.rope_table * M * rope_width;
    specdec_layer_qkv(layer.format, current, layer.input_norm, eps, layer.qkv_w, layer.qkv_bias, layer.q_norm,
                      layer.k_norm, layer.q_norm_size, layer.k_norm_size, layer_cos, layer_sin, qkv, M,
                      layer.qkv_padded, layer.qkv_in, layer.qkv_width, layer.heads, layer.kv_heads, layer.d,
                      layer.rotary);
    const int64_t width = layer.heads * layer.d;
    std::memset(attended, 0, sizeof(float) * M * width);  // padding rows stay zero, as the per-layer path's
    const float* q = qkv;
    const float* k = qkv + width;
    const float* v = k + layer.kv_heads * layer.d;
    const float scale = static_cast<float>(layer.scale), softcap = static_cast<float>(layer.softcap);
    for (int64_t c = 0; c < num_chains; ++c) {
      const int64_t* chain = chains + 4 * c;
      specdec_attend_chain(q, k, v, layer.qkv_padded, keys[l], values[l], chain[3], head_stride, chain_slots[c],
                           chain[2], chain[0], chain[1], layer.heads, layer.kv_heads, layer.d, scale, attended,
                           kv_format, softcap);
    }
    const int64_t j = layer.query_list;
    if (j >= 0 && list_queries[j] > 0)
      specdec_attend(q, k, v, layer.qkv_padded, keys[l], values[l], row_stride, head_stride, list_tokens[j],
                     list_rows[j], list_slots[j], list_counts[j], list_slots_stride[j], list_queries[j], layer.heads,
                     layer.kv_heads, layer.d, scale, attended, kv_format, softcap);
    specdec_layer_mlp(layer.format, current, attended, layer.o_w, layer.o_bias, layer.o_norm, layer.post_norm, eps,
                      layer.gate_up_w, layer.gate_up_bias, layer.down_w, layer.down_bias, layer.down_norm,
                      layer.activation, next, M, hidden, width, layer.inter, layer.hidden_padded,
                      layer.gate_up_padded);
    float* done = next;
    next = current;
    current = done;
    if (hidden_at[l] >= 0) std::memcpy(hidden_out + hidden_at[l] * M * hidden, current, sizeof(float) * M * hidden);
  }
  if (current != x) std::memcpy(x, current, sizeof(float) * M * hidden);
}
}
