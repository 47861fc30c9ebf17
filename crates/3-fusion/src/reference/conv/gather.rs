//! The column matrix: where each row reads each filter tap ([`PixelMap`]), the zero-padded copy
//! of the source that makes every tap a fixed offset ([`Layout`], [`PadBuf`]), and the gather of
//! a tile's rows ([`Gatherer`]).

use std::borrow::Cow;

use rayon::prelude::*;

use super::super::element::Real;
use super::super::params::ConvParams;

/// Marks a filter tap that reads padding (zeros) in [`PixelMap::row`].
const NO_PIXEL: usize = usize::MAX;

/// Where each column row reads each filter tap `tap = r*s_dim + s`.
#[derive(Debug, Clone, Copy)]
pub(super) enum PixelMap {
    /// fprop's (and wgrad's) rows: output pixels `(n, p, q)`, reading input pixel
    /// `(n, p*stride_h - pad_h + r*dil_h, q*stride_w - pad_w + s*dil_w)`.
    Fprop(ConvParams),
    /// dgrad's rows: input pixels `(n, ih, iw)`, reading the output pixel `(op, oq)` with
    /// `op*stride_h = ih + pad_h - r*dil_h` (and the same for `w`), where there is one.
    Dgrad(ConvParams),
}

impl PixelMap {
    pub(super) fn fprop(p: &ConvParams) -> Self {
        PixelMap::Fprop(*p)
    }

    pub(super) fn dgrad(p: &ConvParams) -> Self {
        PixelMap::Dgrad(*p)
    }

    /// The row space: (batch, rows, columns) of the pixels the column rows stand for.
    fn dims(&self) -> (usize, usize) {
        match self {
            PixelMap::Fprop(p) => (p.out_h(), p.out_w()),
            PixelMap::Dgrad(p) => (p.h, p.w),
        }
    }

    /// Column row `row`'s pixel `(n, i, j)` in the row space.
    fn coords(&self, row: usize) -> [usize; 3] {
        let (h, w) = self.dims();
        let (n, rem) = (row / (h * w), row % (h * w));
        [n, rem / w, rem % w]
    }

    /// The next row's pixel after `at`.
    fn advance(&self, at: &mut [usize; 3]) {
        let (h, w) = self.dims();
        at[2] += 1;
        if at[2] == w {
            at[2] = 0;
            at[1] += 1;
            if at[1] == h {
                at[1] = 0;
                at[0] += 1;
            }
        }
    }

    /// For the column row of pixel `at` ([`PixelMap::coords`]), the flat source pixel of every
    /// tap, or [`NO_PIXEL`].
    fn row(&self, at: [usize; 3], out: &mut [usize]) {
        if self.interior(at, out) {
            return;
        }
        self.row_general(at, out);
    }

    /// [`PixelMap::row`] for a row none of whose taps falls outside the source (or, in
    /// dgrad, between the strided output pixels): every tap's pixel is the row's first plus a
    /// fixed offset. Returns false, leaving `out` as it was, for other rows.
    fn interior(&self, [n, op, oq]: [usize; 3], out: &mut [usize]) -> bool {
        match *self {
            PixelMap::Fprop(p) => {
                let (Some(ih), Some(iw)) = (
                    (op * p.stride_h).checked_sub(p.pad_h),
                    (oq * p.stride_w).checked_sub(p.pad_w),
                ) else {
                    return false;
                };
                if ih + (p.r - 1) * p.dil_h >= p.h || iw + (p.s - 1) * p.dil_w >= p.w {
                    return false;
                }
                let base = (n * p.h + ih) * p.w + iw;
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let row_base = base + r * p.dil_h * p.w;
                    for (s, t) in taps.iter_mut().enumerate() {
                        *t = row_base + s * p.dil_w;
                    }
                }
                true
            }
            PixelMap::Dgrad(p) => {
                if p.stride_h != 1 || p.stride_w != 1 {
                    return false;
                }
                let (out_h, out_w) = (p.out_h(), p.out_w());
                let (ih, iw) = (op, oq);
                // Tap (r, s) reads output pixel (ih + pad_h - r·dil_h, iw + pad_w - s·dil_w).
                let (th, tw) = (ih + p.pad_h, iw + p.pad_w);
                if th < (p.r - 1) * p.dil_h
                    || tw < (p.s - 1) * p.dil_w
                    || th >= out_h
                    || tw >= out_w
                {
                    return false;
                }
                let base = (n * out_h + th) * out_w + tw;
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let row_base = base - r * p.dil_h * out_w;
                    for (s, t) in taps.iter_mut().enumerate() {
                        *t = row_base - s * p.dil_w;
                    }
                }
                true
            }
        }
    }

    /// [`PixelMap::row`] for any row.
    fn row_general(&self, [n, i, j]: [usize; 3], out: &mut [usize]) {
        // Rows and columns of the filter are independent: find each tap row's source row and
        // each tap column's source column once, then combine.
        let mut cols = [NO_PIXEL; 16];
        let mut cols_vec;
        let (p, s) = match self {
            PixelMap::Fprop(p) | PixelMap::Dgrad(p) => (*p, p.s),
        };
        let cols: &mut [usize] = if s <= cols.len() {
            &mut cols[..s]
        } else {
            cols_vec = vec![NO_PIXEL; s];
            &mut cols_vec
        };
        match *self {
            PixelMap::Fprop(_) => {
                let (op, oq) = (i, j);
                for (s, c) in cols.iter_mut().enumerate() {
                    *c = (oq * p.stride_w + s * p.dil_w)
                        .checked_sub(p.pad_w)
                        .filter(|&iw| iw < p.w)
                        .unwrap_or(NO_PIXEL);
                }
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let ih = (op * p.stride_h + r * p.dil_h)
                        .checked_sub(p.pad_h)
                        .filter(|&ih| ih < p.h);
                    for (t, &iw) in taps.iter_mut().zip(cols.iter()) {
                        *t = match ih {
                            Some(ih) if iw != NO_PIXEL => (n * p.h + ih) * p.w + iw,
                            _ => NO_PIXEL,
                        };
                    }
                }
            }
            PixelMap::Dgrad(_) => {
                let (out_h, out_w) = (p.out_h(), p.out_w());
                let (ih, iw) = (i, j);
                let along =
                    |i: usize, pad: usize, t: usize, dil: usize, stride: usize, o: usize| {
                        (i + pad)
                            .checked_sub(t * dil)
                            .filter(|th| th % stride == 0)
                            .map(|th| th / stride)
                            .filter(|&op| op < o)
                    };
                for (s, c) in cols.iter_mut().enumerate() {
                    *c = along(iw, p.pad_w, s, p.dil_w, p.stride_w, out_w).unwrap_or(NO_PIXEL);
                }
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let op = along(ih, p.pad_h, r, p.dil_h, p.stride_h, out_h);
                    for (t, &oq) in taps.iter_mut().zip(cols.iter()) {
                        *t = match op {
                            Some(op) if oq != NO_PIXEL => (n * out_h + op) * out_w + oq,
                            _ => NO_PIXEL,
                        };
                    }
                }
            }
        }
    }
}

/// Gathers rows of a column matrix (see [`gather`]) from a source tensor with `cin` channels.
#[derive(Debug)]
pub(super) enum Gatherer<'a, A: Clone> {
    /// Through a zero-padded copy of the source, in which every tap of every row reads the
    /// pixel at a fixed offset from the row's base pixel: no bounds checks, and runs of taps
    /// that read consecutive pixels (a filter row of fprop) are copied at once. The column
    /// matrix is the same as [`gather`]'s (padding reads `+0`, as its zero fill).
    Padded(Padded<'a, A>),
    /// By [`PixelMap::row`] per row (dgrad of a strided conv, or padding past the filter).
    General {
        src: Cow<'a, [A]>,
        cin: usize,
        taps: usize,
        map: PixelMap,
    },
}

/// See [`Gatherer::Padded`].
#[derive(Debug)]
pub(super) struct Padded<'a, A: Clone> {
    /// The source, NHWC `[n, hp, wp, cin]` with its zero border.
    pub(super) src: Cow<'a, [A]>,
    layout: Layout,
}

/// The geometry of a [`Gatherer::Padded`] source.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Layout {
    cin: usize,
    taps: usize,
    /// Images of the source.
    n: usize,
    /// Height and width of the padded source.
    hp: usize,
    wp: usize,
    /// Zero rows above and zero columns left of the source in its padded copy.
    top: usize,
    left: usize,
    /// Height and width of the source.
    h: usize,
    w: usize,
    /// The row space's height and width (as [`PixelMap::dims`]).
    dims: (usize, usize),
    /// Padded pixels the base moves per row-space step down and across.
    step: (usize, usize),
    /// `(first tap, taps, pixel offset from the base)` of each run of taps reading consecutive
    /// pixels, in tap order.
    runs: Vec<(usize, usize, usize)>,
}

impl Layout {
    /// The padded layout of `map`'s source, or `None` where the gather goes by
    /// [`PixelMap::row`] (dgrad of a strided conv, or padding past the filter's reach).
    pub(super) fn of(map: PixelMap, cin: usize, taps: usize) -> Option<Layout> {
        // (images, padded height, width, top and left border, source height, width, steps)
        let (n, hp, wp, top, left, h, w, step) = match map {
            PixelMap::Fprop(p) => (
                p.n,
                p.h + 2 * p.pad_h,
                p.w + 2 * p.pad_w,
                p.pad_h,
                p.pad_w,
                p.h,
                p.w,
                (p.stride_h, p.stride_w),
            ),
            PixelMap::Dgrad(p) => {
                let (reach_h, reach_w) = ((p.r - 1) * p.dil_h, (p.s - 1) * p.dil_w);
                if p.stride_h != 1 || p.stride_w != 1 || p.pad_h > reach_h || p.pad_w > reach_w {
                    return None;
                }
                (
                    p.n,
                    p.h + reach_h,
                    p.w + reach_w,
                    reach_h - p.pad_h,
                    reach_w - p.pad_w,
                    p.out_h(),
                    p.out_w(),
                    (1, 1),
                )
            }
        };
        let p = match map {
            PixelMap::Fprop(p) | PixelMap::Dgrad(p) => p,
        };
        // Tap (r, s) reads, relative to the row's base pixel: fprop (r·dil_h, s·dil_w);
        // dgrad ((r_max − r)·dil_h, (s_max − s)·dil_w) (see `PixelMap::interior`).
        let offset = |r: usize, s: usize| match map {
            PixelMap::Fprop(_) => r * p.dil_h * wp + s * p.dil_w,
            PixelMap::Dgrad(_) => (p.r - 1 - r) * p.dil_h * wp + (p.s - 1 - s) * p.dil_w,
        };
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for t in 0..taps {
            let off = offset(t / p.s, t % p.s);
            match runs.last_mut() {
                Some((_, len, start)) if *start + *len == off => *len += 1,
                _ => runs.push((t, 1, off)),
            }
        }
        Some(Layout {
            cin,
            taps,
            n,
            hp,
            wp,
            top,
            left,
            h,
            w,
            dims: map.dims(),
            step,
            runs,
        })
    }

    /// Whether the padded copy is the source itself (no zero border).
    fn borderless(&self) -> bool {
        self.top == 0 && self.left == 0 && self.hp == self.h && self.wp == self.w
    }

    /// Elements of the padded copy.
    fn elems(&self) -> usize {
        self.n * self.hp * self.wp * self.cin
    }

    /// Writes the padded copy of `src` (not [`Src::Padded`]) into `out`, resized to
    /// [`Layout::elems`]: each source row copied (or filled) straight into place, and the
    /// border zeroed unless `out` already holds this layout's zero border (storage kept from
    /// an earlier call is reused without clearing it first).
    pub(super) fn fill<A: Real>(&self, src: Src<'_, A>, out: &mut PadBuf<A>) {
        let cin = self.cin;
        let (hp, wp, top, left, h, w) = (self.hp, self.wp, self.top, self.left, self.h, self.w);
        // Only this function writes a `PadBuf`, and it leaves the border of `clean` zero.
        let clean = out.clean.as_ref() == Some(self) && out.data.len() == self.elems();
        out.clean = None;
        let data = &mut out.data;
        data.resize(self.elems(), A::ZERO);
        let image = hp * wp * cin;
        if image == 0 {
            return;
        }
        if h * w * cin == 0 {
            data.fill(A::ZERO);
            out.clean = Some(self.clone());
            return;
        }
        data.par_chunks_mut(image)
            .enumerate()
            .for_each(|(img, out)| {
                let (above, rest) = out.split_at_mut(top * wp * cin);
                let (rows, below) = rest.split_at_mut(h * wp * cin);
                if !clean {
                    above.fill(A::ZERO);
                    below.fill(A::ZERO);
                }
                for (row, line) in rows.chunks_exact_mut(wp * cin).enumerate() {
                    let (before, line) = line.split_at_mut(left * cin);
                    let (dst, after) = line.split_at_mut(w * cin);
                    if !clean {
                        before.fill(A::ZERO);
                        after.fill(A::ZERO);
                    }
                    let first = (img * h + row) * w;
                    match src {
                        // (`Src::Padded` is used as it is, never refilled: see `from_src_in`.)
                        Src::Acc(v) | Src::Padded(v) => {
                            dst.copy_from_slice(&v[first * cin..][..w * cin])
                        }
                        Src::Fill { fill, .. } => fill(first, dst),
                    }
                }
            });
        out.clean = Some(self.clone());
    }
}

/// Storage for a padded copy kept from call to call ([`Layout::fill`]), with the layout whose
/// zero border it holds, if any (a refill of the same layout then rewrites only the interior).
#[derive(Debug, Default)]
pub(crate) struct PadBuf<A> {
    /// The padded copy.
    pub(crate) data: Vec<A>,
    clean: Option<Layout>,
}

/// A conv's source tensor as the gather reads it, in the arithmetic type.
#[derive(Clone, Copy)]
pub(crate) enum Src<'a, A> {
    /// Already in the arithmetic type.
    Acc(&'a [A]),
    /// Computed on the way into the gather's padded copy: `fill(first, dst)` writes the values
    /// of the `dst.len() / cin` consecutive pixels from flat pixel `first` (the source has
    /// `pixels` pixels).
    Fill {
        pixels: usize,
        fill: &'a (dyn Fn(usize, &mut [A]) + Sync),
    },
    /// An fprop (or wgrad) source already in its gather's padded layout, as
    /// [`pad_fprop_input`] wrote it for the same conv shape.
    Padded(&'a [A]),
}

impl<A> std::fmt::Debug for Src<'_, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Src::Acc(v) => write!(f, "Src::Acc({} values)", v.len()),
            Src::Fill { pixels, .. } => write!(f, "Src::Fill({pixels} pixels)"),
            Src::Padded(v) => write!(f, "Src::Padded({} values)", v.len()),
        }
    }
}

impl<'a, A: Real> Src<'a, A> {
    /// The whole tensor (`cin` channels) in the arithmetic type.
    fn materialize(self, cin: usize) -> Cow<'a, [A]> {
        match self {
            // Only fprop sources come padded, and fprop always gathers through the padded
            // layout (`Layout::of`): never reached.
            Src::Acc(v) | Src::Padded(v) => Cow::Borrowed(v),
            Src::Fill { pixels, fill } => {
                let mut v = vec![A::ZERO; pixels * cin];
                if !v.is_empty() {
                    fill(0, &mut v);
                }
                Cow::Owned(v)
            }
        }
    }
}

impl<'a, A: Real> Gatherer<'a, A> {
    pub(super) fn new(map: PixelMap, src: &'a [A], cin: usize, taps: usize) -> Self {
        Self::from_src(map, Src::Acc(src), cin, taps)
    }

    pub(super) fn from_src(map: PixelMap, src: Src<'a, A>, cin: usize, taps: usize) -> Self {
        Self::from_src_in(map, src, cin, taps, None)
    }

    /// [`Gatherer::from_src`], writing a padded copy (where one is made) into `buf` when given
    /// (storage kept for reuse) instead of a new vector.
    pub(super) fn from_src_in(
        map: PixelMap,
        src: Src<'a, A>,
        cin: usize,
        taps: usize,
        buf: Option<&'a mut PadBuf<A>>,
    ) -> Self {
        let Some(layout) = Layout::of(map, cin, taps) else {
            return Gatherer::General {
                src: src.materialize(cin),
                cin,
                taps,
                map,
            };
        };
        let src = match src {
            // Already in the padded layout (an fprop source: its layout always exists).
            Src::Padded(v) => Cow::Borrowed(v),
            // No border: the source itself.
            Src::Acc(v) if layout.borderless() => Cow::Borrowed(v),
            src => match buf {
                Some(buf) => {
                    layout.fill(src, buf);
                    Cow::Borrowed(&buf.data[..])
                }
                None => {
                    let mut padded = PadBuf::default();
                    layout.fill(src, &mut padded);
                    Cow::Owned(padded.data)
                }
            },
        };
        Gatherer::Padded(Padded { src, layout })
    }

    /// Fills `col` with rows `first..first + n_rows` of the column matrix (see [`gather`]).
    pub(super) fn gather(&self, first: usize, n_rows: usize, col: &mut Vec<A>) {
        match self {
            Gatherer::General {
                src,
                cin,
                taps,
                map,
            } => gather(src, *cin, *taps, first, n_rows, map, col),
            Gatherer::Padded(g) => g.gather(first, n_rows, col),
        }
    }
}

impl<A: Real> Padded<'_, A> {
    fn gather(&self, first: usize, n_rows: usize, col: &mut Vec<A>) {
        let l = &self.layout;
        let (cin, width) = (l.cin, l.taps * l.cin);
        // Every element is written below; resizing only grows the buffer.
        col.resize(n_rows * width, A::ZERO);
        if width == 0 {
            return;
        }
        let mut rows = col.chunks_exact_mut(width);
        self.walk(first, n_rows, |base| {
            let Some(row) = rows.next() else { return };
            for &(t, len, off) in &l.runs {
                let at = (base + off) * cin;
                copy_pixels(
                    &mut row[t * cin..(t + len) * cin],
                    &self.src[at..at + len * cin],
                );
            }
        });
    }

    /// Each column's element offset from its row's base element ([`Padded::bases`]), so
    /// element `(row, d)` of the column matrix is `src[base(row) + offset(d)]`.
    pub(super) fn column_offsets(&self) -> Vec<usize> {
        let cin = self.layout.cin;
        let mut eoff = vec![0; self.layout.taps * cin];
        for &(t, len, off) in &self.layout.runs {
            let run = &mut eoff[t * cin..(t + len) * cin];
            for (i, e) in run.iter_mut().enumerate() {
                *e = off * cin + i;
            }
        }
        eoff
    }

    /// The element index in the padded source of each of rows `first..first + n_rows`' base
    /// pixel (the pixel its first tap reads, before the run offsets), into `out`.
    pub(super) fn bases(&self, first: usize, n_rows: usize, out: &mut Vec<usize>) {
        out.clear();
        let cin = self.layout.cin;
        self.walk(first, n_rows, |base| out.push(base * cin));
    }

    /// Calls `row(base)` with the base pixel of each of rows `first..first + n_rows`, in order.
    fn walk(&self, first: usize, n_rows: usize, mut row: impl FnMut(usize)) {
        let l = &self.layout;
        let (h, w) = l.dims;
        if h * w == 0 {
            return;
        }
        let (sh, sw) = l.step;
        let base_of = |n: usize, i: usize, j: usize| (n * l.hp + i * sh) * l.wp + j * sw;
        let (mut n, mut i, mut j) = (first / (h * w), first % (h * w) / w, first % w);
        let mut base = base_of(n, i, j);
        for _ in 0..n_rows {
            row(base);
            j += 1;
            base += sw;
            if j == w {
                j = 0;
                i += 1;
                if i == h {
                    i = 0;
                    n += 1;
                }
                base = base_of(n, i, j);
            }
        }
    }
}

/// Fills `col` with rows `first..first + n_rows` of the column matrix `[rows, taps*cin]`: row
/// `i`, tap `t` holds the `cin` values of `src`'s pixel for that tap ([`PixelMap::row`]), or
/// zeros.
fn gather<A: Real>(
    src: &[A],
    cin: usize,
    taps: usize,
    first: usize,
    n_rows: usize,
    map: &PixelMap,
    col: &mut Vec<A>,
) {
    // Every element is written below (a copy or zeros); resizing only grows the buffer.
    col.resize(n_rows * taps * cin, A::ZERO);
    let mut pixels = vec![NO_PIXEL; taps];
    let mut at = map.coords(first);
    for row in col.chunks_exact_mut(taps * cin) {
        map.row(at, &mut pixels);
        map.advance(&mut at);
        // Runs of taps that read consecutive pixels (a filter row in fprop) are one copy.
        let mut t = 0;
        while t < taps {
            let pix = pixels[t];
            let mut run = 1;
            if pix != NO_PIXEL {
                while t + run < taps && pixels[t + run] == pix + run {
                    run += 1;
                }
            }
            let dst = &mut row[t * cin..(t + run) * cin];
            if pix == NO_PIXEL {
                dst.fill(A::ZERO);
            } else {
                copy_pixels(dst, &src[pix * cin..(pix + run) * cin]);
            }
            t += run;
        }
    }
}

/// `dst.copy_from_slice(src)`, inlined for a single pixel of the usual channel counts.
#[inline]
fn copy_pixels<A: Real>(dst: &mut [A], src: &[A]) {
    fn fixed<A: Copy, const N: usize>(dst: &mut [A], src: &[A]) -> bool {
        match (<&mut [A; N]>::try_from(dst), <&[A; N]>::try_from(src)) {
            (Ok(d), Ok(s)) => {
                *d = *s;
                true
            }
            _ => false,
        }
    }
    let done = match src.len() {
        8 => fixed::<A, 8>(dst, src),
        16 => fixed::<A, 16>(dst, src),
        24 => fixed::<A, 24>(dst, src),
        32 => fixed::<A, 32>(dst, src),
        48 => fixed::<A, 48>(dst, src),
        96 => fixed::<A, 96>(dst, src),
        _ => false,
    };
    if !done {
        dst.copy_from_slice(src);
    }
}

/// Writes `x` in the padded layout the fprop (and wgrad) gather of `p` reads, into `out`
/// (resized; storage kept from an earlier call is reused, only the border zeroed): the
/// [`Src::Padded`] form of `x` for `fprop_chunks` and `wgrad_src`, which then gather the
/// same column matrix as from `x` itself. `p` validated, lengths checked.
pub(crate) fn pad_fprop_input<A: Real>(p: &ConvParams, x: Src<'_, A>, out: &mut PadBuf<A>) {
    let taps = p.r * p.s;
    // An fprop map always has a padded layout.
    if let Some(layout) = Layout::of(PixelMap::fprop(p), p.c, taps) {
        match x {
            Src::Padded(v) => {
                out.clean = None;
                out.data.clear();
                out.data.extend_from_slice(v);
            }
            x => layout.fill(x, out),
        }
    }
}
