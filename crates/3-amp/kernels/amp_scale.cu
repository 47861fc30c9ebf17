// amp_scale.cu: the loss-scale update, the last kernel of a step.
// Twin: cudnn_cbr_amp::range::update_loss_scale.

// Launch <<<1, 1>>> (extra threads return). growth_interval == 0 is the fixed policy.
// Overflow: scale = max(scale * 0.5, 1), tracker = 0, skipped += 1.
// Good step: step += 1, tracker += 1; with growth, when tracker >= interval:
//            scale = min(scale * factor, max_scale), tracker = 0.
// Always: the flag is cleared for the next step.
extern "C" __global__ void amp_loss_scale_update(AmpScalars* __restrict__ s,
                                                 unsigned int growth_interval,
                                                 float growth_factor, float max_scale) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (s->overflow != 0u) {
        s->loss_scale = fmaxf(__fmul_rn(s->loss_scale, AMP_BACKOFF_FACTOR), AMP_MIN_LOSS_SCALE);
        s->growth_tracker = 0u;
        s->skipped = s->skipped + 1u;
    } else {
        s->step = s->step + 1u;
        unsigned int t = s->growth_tracker + 1u;
        if (growth_interval != 0u && t >= growth_interval) {
            s->loss_scale = fminf(__fmul_rn(s->loss_scale, growth_factor), max_scale);
            t = 0u;
        }
        s->growth_tracker = t;
    }
    s->overflow = 0u;
}
