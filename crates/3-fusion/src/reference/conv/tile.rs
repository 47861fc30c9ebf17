//! One tile's product, straight from the padded source where `direct.rs` runs it (the same
//! bits), else by the gather and the GEMM.

use super::super::element::{Mat, Real};
use super::super::error::Result;
use super::super::transpose::transpose;
use super::gather::{Gatherer, Padded};

/// A tile's gathered column rows and their bases, kept from tile to tile (and wgrad's rows of
/// `dy` where they are filled per tile).
#[derive(Debug, Default)]
pub(super) struct Scratch<A> {
    pub(super) col: Vec<A>,
    pub(super) bases: Vec<usize>,
    pub(super) rows: Vec<A>,
}

/// `tile [n_rows, cout] = col rows first.. · weights [depth, cout]`: straight from the padded
/// source where `direct.rs` runs the tile (the same bits), else by the gather and the GEMM.
pub(super) struct TileProduct<'g, 'a, A: Real> {
    gatherer: &'g Gatherer<'a, A>,
    depth: usize,
    weights: Mat<'g, A>,
    cout: usize,
    /// Where the tiles may go direct.
    direct: Option<Direct<'g, 'a, A>>,
}

/// What a direct tile reads: the padded source, each column's offset from a row's base, and
/// `weights` row-major.
struct Direct<'g, 'a, A: Real> {
    src: &'g Padded<'a, A>,
    eoff: Vec<usize>,
    w: &'g [A],
}

impl<'g, 'a, A: Real> TileProduct<'g, 'a, A> {
    /// `weights` as a row-major slice goes into `dense`'s storage where the tiles go direct
    /// and it is not one already (a caller that keeps `dense` from call to call allocates
    /// nothing).
    pub(super) fn new(
        gatherer: &'g Gatherer<'a, A>,
        depth: usize,
        weights: Mat<'g, A>,
        cout: usize,
        dense: &'g mut Vec<A>,
    ) -> Self {
        // (Whether `gemm` takes its kernel path is checked per tile, in `tile`; with fewer than
        // two columns or a reduction under 3 it never does.)
        let direct = match gatherer {
            Gatherer::Padded(g) if A::DIRECT && depth >= 3 && cout >= 2 => Some(Direct {
                src: g,
                eoff: g.column_offsets(),
                w: dense_in(weights, depth, cout, dense),
            }),
            _ => None,
        };
        TileProduct {
            gatherer,
            depth,
            weights,
            cout,
            direct,
        }
    }

    /// The product's output columns.
    pub(super) fn cout(&self) -> usize {
        self.cout
    }

    pub(super) fn tile(
        &self,
        first: usize,
        n_rows: usize,
        s: &mut Scratch<A>,
        out: &mut [A],
    ) -> Result<()> {
        if let Some(d) = &self.direct {
            if gemm_kernel_path(n_rows, self.depth, self.cout) {
                d.src.bases(first, n_rows, &mut s.bases);
                if A::direct(&d.src.src, &s.bases, &d.eoff, d.w, self.cout, out, false) {
                    return Ok(());
                }
            }
        }
        self.gatherer.gather(first, n_rows, &mut s.col);
        A::gemm(
            n_rows,
            self.depth,
            self.cout,
            Mat::row_major(&s.col, self.depth),
            self.weights,
            A::ZERO,
            out,
        )
    }
}

/// Whether the `gemm` crate multiplies an `m × depth` by a `depth × n` matrix on its FMA kernel
/// path, whose bits the direct tiles give (direct.rs): a reduced dimension of at least 3 (no
/// vector-vector case), at least two rows and two columns (no matrix-vector case), and over
/// 256 outputs (smaller products it sums across lanes for some operand layouts: those stay on
/// its path).
pub(super) fn gemm_kernel_path(m: usize, depth: usize, n: usize) -> bool {
    depth >= 3 && m >= 2 && n >= 2 && m * n > 256
}

/// `m` (`rows x cols`) as a row-major slice: borrowed where it already is one, else copied
/// into `buf`'s storage (a transposed one by `transpose.rs`).
fn dense_in<'m, A: Real>(m: Mat<'m, A>, rows: usize, cols: usize, buf: &'m mut Vec<A>) -> &'m [A] {
    if m.col_stride == 1 && m.row_stride == cols && m.data.len() >= rows * cols {
        return &m.data[..rows * cols];
    }
    if m.row_stride == 1 && m.col_stride == rows && m.data.len() >= rows * cols {
        // Every value is overwritten: only a longer buffer's new part is zeroed.
        buf.resize(rows * cols, A::ZERO);
        transpose(&m.data[..rows * cols], cols, rows, buf);
        return buf;
    }
    buf.clear();
    for i in 0..rows {
        buf.extend((0..cols).map(|j| m.data[i * m.row_stride + j * m.col_stride]));
    }
    buf
}
