"""Where an expert lives and how it moves: the fast tier's slots, the slow tier, the transfers between them.
Moves slot-sized bytes without knowing their encoding (formats/) or what runs them (compute/)."""
