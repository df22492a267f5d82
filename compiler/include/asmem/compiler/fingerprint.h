// The model fingerprint a dictionary records (asmem::ModelFingerprint, dictionary.h): what
// must match between the model a dictionary was compiled with and the model it serves.
#pragma once

#include <string>

#include "asmem/dictionary.h"
#include "asmem/model/config.h"
#include "asmem/model/weights.h"

namespace asmem {

// Architecture, shapes and RoPE from the config; name from config().name;
// attn_weights_hash = XXH64 (seed 0) over the fp32 bytes (as read_f32 returns them) of, for
// layer 0..L-1 in order, q_proj, k_proj, v_proj, o_proj weights, each followed by its bias
// when the source has one; and, with `all_weights`, weights_hash = weights_hash(weights)
// (else 0: not compared). Reads the attention projections (and with `all_weights` every
// tensor once more), dequantizing quantized files. Errors from the source propagate. A
// check against a dictionary passes all_weights = (its weights_hash != 0): the whole model
// is read only where the dictionary recorded the hash.
ModelFingerprint fingerprint_of(const WeightSource& weights, bool all_weights = true);

// Hash of every weight a forward reads: XXH64 (seed 0) over, for every tensor name in
// WeightSource::names() order, the name, its shape and its fp32 values (as read_f32
// returns them). Reads the whole model once.
uint64_t weights_hash(const WeightSource& weights);

// RoPE scaling in one line, the form ModelFingerprint::rope_scaling stores:
//   none | linear:<factor> | llama3:<factor>:<low>:<high>:<original_max_position> |
//   factors:<n>:<XXH64 of the n fp32 factors, 16 hex digits>
// Numbers use the shortest form that round-trips ("8", "0.5").
std::string rope_scaling_summary(const RopeScaling& rs);

}  // namespace asmem
