//! Typed names of a layer's buffers: a [`Key<T>`] carries the element type, so binding a
//! `CudaSlice<f32>` where the graphs read FP16 does not compile.
//!
//! Which keys a layer binds depends on its route and input kind: [`CbrLayer::buffers`]
//! (this layer's, bound with [`DeviceBuffers::bind`]) and [`CbrLayer::prev_buffers`] (the
//! previous layer's, bound with [`DeviceBuffers::bind_prev`]) list them. A test checks that
//! every buffer any route binds has a key here with the graphs' element type.
//!
//! [`CbrLayer::buffers`]: super::CbrLayer::buffers
//! [`CbrLayer::prev_buffers`]: super::CbrLayer::prev_buffers
//! [`DeviceBuffers::bind`]: super::DeviceBuffers::bind
//! [`DeviceBuffers::bind_prev`]: super::DeviceBuffers::bind_prev

use super::layer::Src;
use crate::exec::DeviceElement;
use crate::graph::DataType;
use half::f16;
use std::fmt;
use std::marker::PhantomData;

/// The typed name of a layer buffer.
pub struct Key<T> {
    name: &'static str,
    // `fn() -> T`: the key holds no `T`, so it is `Send`, `Sync` and `Copy` whatever `T` is.
    _elem: PhantomData<fn() -> T>,
}

impl<T> Key<T> {
    const fn new(name: &'static str) -> Self {
        Key {
            name,
            _elem: PhantomData,
        }
    }

    /// The buffer's name, as [`BufferSpec::name`](super::BufferSpec::name) spells it.
    pub const fn name(self) -> &'static str {
        self.name
    }

    /// This layer's buffer of this name, as a graph binding names it ([`Src::This`]).
    pub const fn this(self) -> Src {
        Src::This(self.name)
    }

    /// The previous layer's buffer of this name ([`Src::Prev`]).
    pub const fn prev(self) -> Src {
        Src::Prev(self.name)
    }
}

impl<T: DeviceElement> Key<T> {
    /// The element type the graphs read and write through this key.
    pub const fn dtype(self) -> DataType {
        T::DTYPE
    }
}

impl<T> Clone for Key<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Key<T> {}

impl<T> fmt::Debug for Key<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.name)
    }
}

macro_rules! keys {
    ($($(#[$doc:meta])* $id:ident: $t:ty = $name:literal;)*) => {
        $($(#[$doc])* pub const $id: Key<$t> = Key::new($name);)*

        /// Every key's name and element type.
        pub const ALL: &[(&str, DataType)] = &[$(($name, <$t as DeviceElement>::DTYPE)),*];
    };
}

keys! {
    /// The layer's input (a first layer's, or a stored activation's copy).
    X: f16 = "x";
    /// The stored activation this layer reads (unfused routes and stored inputs).
    A_PREV: f16 = "a_prev";
    /// The convolution weight, KRSC.
    W: f16 = "w";
    /// The convolution output.
    Y: f16 = "y";
    /// The activation the layer stores (`relu(BN(y))`, plus the residual where it joins).
    A: f16 = "a";
    /// BN output before the activation (unfused routes that store it).
    Y_BN: f16 = "y_bn";
    /// The residual added at a block output.
    RESIDUAL: f16 = "residual";
    /// Σy per channel (GenStats).
    SUM: f32 = "sum";
    /// Σy² per channel (GenStats).
    SQ_SUM: f32 = "sq_sum";
    /// Batch mean saved by the forward pass.
    SAVED_MEAN: f32 = "saved_mean";
    /// Batch inverse standard deviation saved by the forward pass.
    SAVED_INV_STD: f32 = "saved_inv_std";
    /// BN scale γ.
    GAMMA: f32 = "gamma";
    /// BN shift β.
    BETA: f32 = "beta";
    /// The equivalent scale `γ·inv_std` (the next conv's prologue reads it as FP16).
    EQ_SCALE: f16 = "eq_scale";
    /// The equivalent bias `β − mean·γ·inv_std`.
    EQ_BIAS: f16 = "eq_bias";
    /// The shortcut BN's equivalent scale (the dual scale-bias apply).
    RESIDUAL_SCALE: f16 = "residual_scale";
    /// The shortcut BN's equivalent bias.
    RESIDUAL_BIAS: f16 = "residual_bias";
    /// Running mean (read and, after the forward pass, replaced by `running_mean_next`).
    RUNNING_MEAN: f32 = "running_mean";
    /// Running variance.
    RUNNING_VAR: f32 = "running_var";
    /// The updated running mean BN finalize writes.
    RUNNING_MEAN_NEXT: f32 = "running_mean_next";
    /// The updated running variance BN finalize writes.
    RUNNING_VAR_NEXT: f32 = "running_var_next";
    /// Gradient of the convolution output.
    DY: f16 = "dy";
    /// The branch's share of a block output's gradient.
    DY_BRANCH: f16 = "dy_branch";
    /// Gradient before the block-output ReLU's backward.
    DPRE: f16 = "dpre";
    /// Gradient of the weight (FP16, cast into the amp plan's G16).
    DW: f16 = "dw";
    /// Gradient of the input.
    DX: f16 = "dx";
    /// Gradient of the stored activation.
    DA: f16 = "da";
    /// Gradient of the activation this layer read.
    DA_PREV: f16 = "da_prev";
    /// Sum of an activation's gradients (main branch and shortcut).
    DA_SUM: f16 = "da_sum";
    /// Gradient of the previous layer's pre-activation.
    DZ_PREV: f16 = "dz_prev";
    /// dγ.
    DGAMMA: f32 = "dgamma";
    /// dβ.
    DBETA: f32 = "dbeta";
    /// dBN coefficient a (`dx = a·dy + b·x + c`).
    DBN_A: f32 = "dbn_a";
    /// dBN coefficient b.
    DBN_B: f32 = "dbn_b";
    /// dBN coefficient c.
    DBN_C: f32 = "dbn_c";
    /// The apply's dBN coefficient a.
    APPLY_DBN_A: f32 = "apply_dbn_a";
    /// The apply's dBN coefficient b.
    APPLY_DBN_B: f32 = "apply_dbn_b";
    /// The apply's dBN coefficient c.
    APPLY_DBN_C: f32 = "apply_dbn_c";
}

/// The element type of the buffer named `name`, if it has a key.
pub fn dtype_of(name: &str) -> Option<DataType> {
    ALL.iter().find(|(n, _)| *n == name).map(|(_, d)| *d)
}
