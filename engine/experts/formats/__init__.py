"""How an expert's bytes are laid out and turned back into weights: kernels' views, slot encodings, the
checkpoint's own layouts, the quantized sidecar. Knows no tier (tiers/) and no executor (compute/)."""
