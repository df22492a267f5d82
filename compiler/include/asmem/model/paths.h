// Where asmem keeps downloaded assets.
#pragma once

#include <string>

namespace asmem {

// $ASMEM_CACHE_DIR, else $XDG_CACHE_HOME/asmem, else $HOME/.cache/asmem.
std::string cache_dir();
// The bundled SmolLM2-135M-Instruct Q4_1 GGUF inside cache_dir()/models/ (which
// tools/fetch_model.sh fills), or $ASMEM_MODEL when set.
std::string default_model_path();

}  // namespace asmem
