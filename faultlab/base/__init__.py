"""Ground floor: errors, canonical JSON, messages, interrupts, untrusted input, output files,
clocks."""
