//! Tests only: compiled networks checked against an independent autograd implementation
//! (candle-core, f64, CPU), in `tests/`. `tests/independent/` shares no code with cudnn-cbr.
