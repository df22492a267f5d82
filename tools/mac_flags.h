// The command-line flags of the MAC settings (asmem::MacConfig, asmem/reuse.h), in one place
// so every tool spells them the same way:
//   --mac / --no-mac        enable            (default on)
//   --mac-tau X             tau               (0.45; hit when dist < 2 d (1 - tau)^2)
//   --mac-window N          window W          (512)
//   --mac-band N            band r            (256)
//   --mac-front-sink N      front_sink F      (0)
//   --mac-min-context N     min_context       (2048)
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>

#include "asmem/reuse.h"

namespace asmem {

inline void AddMacFlags(CLI::App& app, MacConfig* mac) {
  // Ranges over int32 (the fields' type): their messages name the bounds readably.
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  app.add_flag("--mac,!--no-mac", mac->enable, "in-request attention reuse (MAC) on or off");
  app.add_option("--mac-tau", mac->tau, "MAC match margin tau in [0, 1]: hit when dist < 2d(1-tau)^2")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--mac-window", mac->window, "MAC candidate window W (last W positions)")
      ->check(CLI::Range(1, kMax));
  app.add_option("--mac-band", mac->band, "MAC band r: recent tokens always attended exactly")
      ->check(CLI::Range(0, kMax));
  app.add_option("--mac-front-sink", mac->front_sink, "MAC front sink F: first tokens always attended exactly")
      ->check(CLI::Range(0, kMax));
  app.add_option("--mac-min-context", mac->min_context, "MAC off while a request has fewer tokens")
      ->check(CLI::Range(0, kMax));
}

}  // namespace asmem
