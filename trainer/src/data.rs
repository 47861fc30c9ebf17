//! A synthetic, deterministic, learnable image dataset: each class has a fixed random template
//! (smooth blobs per channel); a sample is its class template plus noise.

use half::f16;

/// Sampler of labelled NHWC images.
#[derive(Debug, Clone)]
pub struct Synthetic {
    /// Image height = width.
    pub hw: usize,
    /// Channels.
    pub channels: usize,
    /// Number of classes.
    pub classes: usize,
    templates: Vec<Vec<f32>>,
    noise: f32,
}

pub(crate) use cudnn_cbr::net::params::{splitmix, uniform};

impl Synthetic {
    /// Templates for `classes` classes of `hw`×`hw`×`channels` images, from `seed`.
    pub fn new(hw: usize, channels: usize, classes: usize, seed: u64) -> Self {
        let mut s = seed ^ 0x5eed_da7a;
        let templates = (0..classes)
            .map(|_| {
                // A few Gaussian blobs per channel with random centres and signs.
                let blobs: Vec<(f32, f32, f32, usize)> = (0..3 * channels)
                    .map(|i| {
                        let cx = (uniform(&mut s) * 0.5 + 0.5) * hw as f32;
                        let cy = (uniform(&mut s) * 0.5 + 0.5) * hw as f32;
                        (cx, cy, uniform(&mut s).signum(), i % channels)
                    })
                    .collect();
                let mut t = vec![0.0f32; hw * hw * channels];
                let sigma2 = (hw as f32 / 4.0).powi(2);
                for y in 0..hw {
                    for x in 0..hw {
                        for &(cx, cy, sign, c) in &blobs {
                            let d2 = (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2);
                            t[(y * hw + x) * channels + c] += sign * (-d2 / sigma2).exp();
                        }
                    }
                }
                t
            })
            .collect();
        Synthetic {
            hw,
            channels,
            classes,
            templates,
            noise: 2.0,
        }
    }

    /// Batch `index` of `batch` images (NHWC FP16) and labels; the same index gives the same
    /// batch. Distinct `stream` values give disjoint sample streams (train vs held-out).
    pub fn batch(&self, batch: usize, index: u64, stream: u64) -> (Vec<f16>, Vec<i32>) {
        let mut s = index.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ stream.wrapping_mul(0x9e37_79b9);
        let per = self.hw * self.hw * self.channels;
        let mut images = Vec::with_capacity(batch * per);
        let mut labels = Vec::with_capacity(batch);
        for _ in 0..batch {
            let label = (splitmix(&mut s) % self.classes as u64) as usize;
            labels.push(label as i32);
            images.extend(
                self.templates[label]
                    .iter()
                    .map(|t| f16::from_f32(t + self.noise * uniform(&mut s))),
            );
        }
        (images, labels)
    }
}
