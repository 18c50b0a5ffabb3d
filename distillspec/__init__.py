"""distillspec: distil draft models for speculative decoding, and measure them exactly."""
