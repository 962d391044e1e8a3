//! Element types and reduction operators.
//!
//! Collectives move bytes; reductions need types. An [`Element`] is a plain number type that can be
//! viewed as bytes and back ([`bytemuck::Pod`]); a [`Reducer`] is an operator erased to bytes so the
//! schedule machine can stay untyped. Data is sent in the host's byte order: every rank of a job is
//! assumed to share one architecture.
//!
//! Operators must be associative. The built-in ones are also commutative. A user operator says
//! whether it is ([`ReduceOp::custom`]); for a non-commutative one, only algorithms that combine in
//! rank order are chosen (operands are always combined as `lower ranks ⊕ higher ranks`).
//!
//! # Half precision
//!
//! [`f16`](struct@f16) (IEEE 754 binary16) and [`bf16`] (bfloat16) are elements like `f32`: the
//! data travels in its 2-byte form, so a reduction moves half the bytes of an `f32` one. Every pairwise step
//! (`acc ⊕ x`, one per message a rank combines) is computed in `f32` and rounded once to the
//! nearest half value, ties to even. For `+` and `×` that *is* correctly rounded half arithmetic:
//! `f32` has at least twice the half types' significand bits plus two (24 ≥ 2·11 + 2), so
//! rounding to `f32` first never changes the final rounding. Partial results between steps are
//! half values; nothing is carried wider from one step to the next, as the blocks that travel are
//! half-sized.
//!
//! What follows for results:
//! - `Min`, `Max` and the logical operators are exact: every algorithm gives the same bits.
//! - `Sum` and `Product` round at each step, so the result depends on the order of combination,
//!   which each algorithm fixes (see [`crate::schedule`]): for a given algorithm, rank count and
//!   data size the result is reproducible bit for bit and the same on every rank, whatever the
//!   arrival order; two algorithms agree exactly only where no step rounds (e.g. small integers).
//!   The error of a sum of `n` ranks' values is at most `γ(n−1) · Σ|xᵢ|` per element with
//!   `γ(k) = k·u / (1 − k·u)`, `u = 2⁻¹¹` for `f16` and `2⁻⁸` for `bf16` (the classic bound for
//!   any summation order; tree-shaped algorithms do better, `γ(⌈log₂ n⌉)`). Overflow gives `±∞`
//!   (`f16` ends at 65504).
//! - Where that error is too large, reduce in `f32` (convert before, round once after): twice the
//!   bytes on the wire, and the rounding to half happens once instead of at every step.

use std::sync::Arc;

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
pub use half::{bf16, f16};

/// A number type collectives can carry and reduce.
pub trait Element: Pod + Send + Sync + PartialOrd + 'static {
    /// The type's name, for messages.
    const NAME: &'static str;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self, b: Self) -> Self;
    /// Bitwise operations; `None` for floating-point types.
    fn bits(a: Self, b: Self, op: BitOp) -> Option<Self>;
    /// Whether the value counts as true for the logical operators (non-zero).
    fn is_true(self) -> bool;
    /// 1 for true, 0 for false.
    fn from_bool(b: bool) -> Self;
    /// `acc[i] = add(acc[i], x[i])` for every `i` (the slices have one length): element by
    /// element unless a type does better (half types convert blocks of elements at once). It
    /// must give the bits `add` gives.
    #[inline(always)]
    fn add_slice(acc: &mut [Self], x: &[Self]) {
        each(acc, x, Self::add);
    }
    /// `acc[i] = mul(acc[i], x[i])` for every `i`, as [`Element::add_slice`].
    #[inline(always)]
    fn mul_slice(acc: &mut [Self], x: &[Self]) {
        each(acc, x, Self::mul);
    }
}

/// `acc[i] = f(acc[i], x[i])` for every `i`: a monomorphic loop the compiler vectorizes.
#[inline(always)]
fn each<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a = f(*a, *b));
}

/// A bitwise operation, for [`Element::bits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitOp {
    /// `a & b`.
    And,
    /// `a | b`.
    Or,
    /// `a ^ b`.
    Xor,
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const NAME: &'static str = stringify!($t);
            #[inline(always)] fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            fn bits(a: Self, b: Self, op: BitOp) -> Option<Self> {
                Some(match op { BitOp::And => a & b, BitOp::Or => a | b, BitOp::Xor => a ^ b })
            }
            fn is_true(self) -> bool { self != 0 }
            fn from_bool(b: bool) -> Self { b as Self }
        }
    )*};
}
int_element!(u8, u16, u32, u64, i8, i16, i32, i64);

macro_rules! float_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const NAME: &'static str = stringify!($t);
            #[inline(always)] fn add(a: Self, b: Self) -> Self { a + b }
            fn mul(a: Self, b: Self) -> Self { a * b }
            fn bits(_: Self, _: Self, _: BitOp) -> Option<Self> { None }
            fn is_true(self) -> bool { self != 0.0 }
            fn from_bool(b: bool) -> Self { if b { 1.0 } else { 0.0 } }
        }
    )*};
}
float_element!(f32, f64);

/// Elements converted per block by the half types' slice operations: two `f32` buffers of this
/// many on the stack (2 KiB), long enough for the conversions' SIMD paths.
const HALF_BLOCK: usize = 256;

/// Half-precision elements: each operation in `f32`, rounded once to the nearest half value
/// (see the module documentation for why that is correctly rounded half arithmetic).
macro_rules! half_element {
    ($($t:ident),*) => {$(
        impl Element for $t {
            const NAME: &'static str = stringify!($t);
            #[inline(always)] fn add(a: Self, b: Self) -> Self { $t::from_f32(a.to_f32() + b.to_f32()) }
            fn mul(a: Self, b: Self) -> Self { $t::from_f32(a.to_f32() * b.to_f32()) }
            fn bits(_: Self, _: Self, _: BitOp) -> Option<Self> { None }
            fn is_true(self) -> bool { self.to_f32() != 0.0 }
            fn from_bool(b: bool) -> Self { if b { $t::ONE } else { $t::ZERO } }
            fn add_slice(acc: &mut [Self], x: &[Self]) { $t::combine(acc, x, |a, b| a + b) }
            fn mul_slice(acc: &mut [Self], x: &[Self]) { $t::combine(acc, x, |a, b| a * b) }
        }
    )*};
}
half_element!(f16, bf16);

/// Slice operations of a half type: `acc[i] = round(f(acc[i], x[i]))` computed in `f32`.
trait Combine: Sized {
    fn combine(acc: &mut [Self], x: &[Self], f: impl Fn(f32, f32) -> f32);
}

impl Combine for f16 {
    #[inline(always)]
    fn combine(acc: &mut [Self], x: &[Self], f: impl Fn(f32, f32) -> f32) {
        half_blocks(acc, x, f);
    }
}

impl Combine for bf16 {
    /// bfloat16 is the upper half of an `f32`: widening is a shift, and rounding to nearest even
    /// is an add on the bits, a loop the compiler vectorizes (the `half` crate's slice conversion
    /// for `bf16` goes element by element, about four times slower here). NaN stays NaN (quiet).
    #[inline(always)]
    fn combine(acc: &mut [Self], x: &[Self], f: impl Fn(f32, f32) -> f32) {
        let widen = |v: bf16| f32::from_bits(u32::from(v.to_bits()) << 16);
        each(acc, x, |a, b| {
            let r = f(widen(a), widen(b));
            let bits = r.to_bits();
            let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            bf16::from_bits(if r.is_nan() { (bits >> 16) as u16 | 0x0040 } else { rounded })
        });
    }
}

/// `acc[i] = round(f(acc[i], x[i]))` computed in `f32`, [`HALF_BLOCK`] elements at a time: the
/// slice conversions use the CPU's conversion instructions where it has them (F16C), and the
/// `f32` loop vectorizes. Rounding is to nearest, ties to even, as the element-wise form (about
/// six times faster than it for `f16` with F16C).
#[inline(always)]
fn half_blocks<T>(acc: &mut [T], x: &[T], f: impl Fn(f32, f32) -> f32)
where
    [T]: HalfFloatSliceExt,
{
    // As the element-wise form, which zips: only the common length is combined.
    let n = acc.len().min(x.len());
    let (acc, x) = (&mut acc[..n], &x[..n]);
    let mut a = [0f32; HALF_BLOCK];
    let mut b = [0f32; HALF_BLOCK];
    for (acc, x) in acc.chunks_mut(HALF_BLOCK).zip(x.chunks(HALF_BLOCK)) {
        let (a, b) = (&mut a[..acc.len()], &mut b[..acc.len()]);
        acc.convert_to_f32_slice(a);
        x.convert_to_f32_slice(b);
        a.iter_mut().zip(b.iter()).for_each(|(a, b)| *a = f(*a, *b));
        acc.convert_from_f32_slice(a);
    }
}

/// A user's element-wise operator: `f(acc, x)` sets `acc[i] = acc[i] ⊕ x[i]`.
pub type UserOp<T> = Arc<dyn Fn(&mut [T], &[T]) + Send + Sync>;

/// A reduction operator on elements of type `T`.
pub enum ReduceOp<T> {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Product,
    /// Smallest element.
    Min,
    /// Largest element.
    Max,
    /// Bitwise and (integers only).
    BitAnd,
    /// Bitwise or (integers only).
    BitOr,
    /// Bitwise exclusive or (integers only).
    BitXor,
    /// 1 where both are non-zero, else 0.
    LogicalAnd,
    /// 1 where either is non-zero, else 0.
    LogicalOr,
    /// 1 where exactly one is non-zero, else 0.
    LogicalXor,
    /// A user operator: `f(acc, x)` sets `acc[i] = acc[i] ⊕ x[i]`.
    Custom {
        /// The operator.
        f: UserOp<T>,
        /// Whether operands may be combined in any order (it must be associative regardless).
        commutative: bool,
    },
}

impl<T> Clone for ReduceOp<T> {
    fn clone(&self) -> Self {
        match self {
            ReduceOp::Sum => ReduceOp::Sum,
            ReduceOp::Product => ReduceOp::Product,
            ReduceOp::Min => ReduceOp::Min,
            ReduceOp::Max => ReduceOp::Max,
            ReduceOp::BitAnd => ReduceOp::BitAnd,
            ReduceOp::BitOr => ReduceOp::BitOr,
            ReduceOp::BitXor => ReduceOp::BitXor,
            ReduceOp::LogicalAnd => ReduceOp::LogicalAnd,
            ReduceOp::LogicalOr => ReduceOp::LogicalOr,
            ReduceOp::LogicalXor => ReduceOp::LogicalXor,
            ReduceOp::Custom { f, commutative } => ReduceOp::Custom { f: f.clone(), commutative: *commutative },
        }
    }
}

impl<T> std::fmt::Debug for ReduceOp<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReduceOp::Custom { commutative, .. } => write!(f, "Custom {{ commutative: {commutative} }}"),
            other => {
                let name = match other {
                    ReduceOp::Sum => "Sum",
                    ReduceOp::Product => "Product",
                    ReduceOp::Min => "Min",
                    ReduceOp::Max => "Max",
                    ReduceOp::BitAnd => "BitAnd",
                    ReduceOp::BitOr => "BitOr",
                    ReduceOp::BitXor => "BitXor",
                    ReduceOp::LogicalAnd => "LogicalAnd",
                    ReduceOp::LogicalOr => "LogicalOr",
                    _ => "LogicalXor",
                };
                f.write_str(name)
            }
        }
    }
}

impl<T: Element> ReduceOp<T> {
    /// A user operator. It must be associative; say whether it is also commutative.
    pub fn custom(f: impl Fn(&mut [T], &[T]) + Send + Sync + 'static, commutative: bool) -> ReduceOp<T> {
        ReduceOp::Custom { f: Arc::new(f), commutative }
    }

    /// Whether operands may be combined in any order (every built-in operator is).
    pub fn is_commutative(&self) -> bool {
        !matches!(self, ReduceOp::Custom { commutative: false, .. })
    }

    /// `acc[i] = acc[i] ⊕ x[i]` for every element. Each built-in operator gets its own
    /// monomorphic loop, which the compiler vectorizes.
    pub fn apply(&self, acc: &mut [T], x: &[T]) {
        match self {
            ReduceOp::Sum => T::add_slice(acc, x),
            ReduceOp::Product => T::mul_slice(acc, x),
            ReduceOp::Min => each(acc, x, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => each(acc, x, |a, b| if b > a { b } else { a }),
            ReduceOp::BitAnd => each(acc, x, |a, b| T::bits(a, b, BitOp::And).unwrap_or(a)),
            ReduceOp::BitOr => each(acc, x, |a, b| T::bits(a, b, BitOp::Or).unwrap_or(a)),
            ReduceOp::BitXor => each(acc, x, |a, b| T::bits(a, b, BitOp::Xor).unwrap_or(a)),
            ReduceOp::LogicalAnd => each(acc, x, |a, b| T::from_bool(a.is_true() && b.is_true())),
            ReduceOp::LogicalOr => each(acc, x, |a, b| T::from_bool(a.is_true() || b.is_true())),
            ReduceOp::LogicalXor => each(acc, x, |a, b| T::from_bool(a.is_true() != b.is_true())),
            ReduceOp::Custom { f, .. } => f(acc, x),
        }
    }

    /// Whether the operator is defined on `T` (bitwise operators are not defined on floats).
    pub fn supported(&self) -> bool {
        let z = T::zeroed();
        !matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor) || T::bits(z, z, BitOp::And).is_some()
    }

    /// The operator erased to bytes, for the schedule machine. A built-in operator erases to a
    /// plain function (no allocation: small reductions erase one per call); a user operator to
    /// a shared closure.
    pub fn erase(&self) -> Reducer {
        /// Each built-in operator once: `index variant`. `builtin::<T, index>` applies it to
        /// bytes holding `T`s (built-ins are commutative, so the order flag does not matter).
        macro_rules! builtins {
            ($($i:literal $v:ident),*) => {{
                fn builtin<T: Element, const OP: u8>(acc: &mut [u8], x: &[u8], _x_first: bool) {
                    let op = match OP {
                        $($i => ReduceOp::<T>::$v,)*
                        _ => unreachable!("not a built-in operator"),
                    };
                    with_typed(acc, x, |acc: &mut [T], x: &[T]| op.apply(acc, x));
                }
                match self {
                    $(ReduceOp::$v => Some(Erased::Builtin(builtin::<T, $i>)),)*
                    ReduceOp::Custom { .. } => None,
                }
            }};
        }
        let builtin = builtins!(0 Sum, 1 Product, 2 Min, 3 Max, 4 BitAnd, 5 BitOr, 6 BitXor, 7 LogicalAnd,
            8 LogicalOr, 9 LogicalXor);
        let f = match builtin {
            Some(f) => f,
            None => {
                let op = self.clone();
                Erased::Custom(Arc::new(move |acc: &mut [u8], x: &[u8], x_first: bool| {
                    with_typed(acc, x, |acc: &mut [T], x: &[T]| {
                        if x_first && !op.is_commutative() {
                            // acc = x ⊕ acc, with an operator that only computes acc ⊕ x in place.
                            let mut tmp = x.to_vec();
                            op.apply(&mut tmp, acc);
                            acc.copy_from_slice(&tmp);
                        } else {
                            op.apply(acc, x);
                        }
                    })
                }))
            }
        };
        Reducer { commutative: self.is_commutative(), elem: size_of::<T>(), f }
    }
}

/// Runs `f` on `acc` and `x` viewed as `T`, copying to aligned storage only when the bytes are
/// not aligned for `T`.
fn with_typed<T: Element>(acc: &mut [u8], x: &[u8], f: impl FnOnce(&mut [T], &[T])) {
    let x_owned: Vec<T>;
    let x: &[T] = match bytemuck::try_cast_slice(x) {
        Ok(x) => x,
        Err(_) => {
            x_owned = bytemuck::pod_collect_to_vec(x);
            &x_owned
        }
    };
    match bytemuck::try_cast_slice_mut::<u8, T>(acc) {
        Ok(acc) => f(acc, x),
        Err(_) => {
            let mut tmp: Vec<T> = bytemuck::pod_collect_to_vec(acc);
            f(&mut tmp, x);
            acc.copy_from_slice(bytemuck::cast_slice(&tmp));
        }
    }
}

type ErasedFn = dyn Fn(&mut [u8], &[u8], bool) + Send + Sync;

/// An operator on bytes: a built-in's function, or a user operator's closure.
#[derive(Clone)]
enum Erased {
    Builtin(fn(&mut [u8], &[u8], bool)),
    Custom(Arc<ErasedFn>),
}

/// A reduction operator erased to bytes.
#[derive(Clone)]
pub struct Reducer {
    commutative: bool,
    elem: usize,
    f: Erased,
}

impl Reducer {
    /// `acc = acc ⊕ x`, or `acc = x ⊕ acc` when `x_first`. Both slices hold whole elements.
    pub fn apply(&self, acc: &mut [u8], x: &[u8], x_first: bool) {
        debug_assert_eq!(acc.len(), x.len());
        match &self.f {
            Erased::Builtin(f) => f(acc, x, x_first),
            Erased::Custom(f) => f(acc, x, x_first),
        }
    }

    /// Whether operands may be combined in any order.
    pub fn is_commutative(&self) -> bool {
        self.commutative
    }

    /// Size of one element in bytes (blocks are split on element boundaries).
    pub fn element_size(&self) -> usize {
        self.elem
    }
}

impl std::fmt::Debug for Reducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reducer").field("commutative", &self.commutative).field("elem", &self.elem).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_and_order() {
        let mut a = [1i32, 5, -3];
        ReduceOp::Sum.apply(&mut a, &[2, 2, 2]);
        assert_eq!(a, [3, 7, -1]);
        ReduceOp::Min.apply(&mut a, &[0, 9, 0]);
        assert_eq!(a, [0, 7, -1]);
        ReduceOp::BitXor.apply(&mut a, &[1, 1, 1]);
        assert_eq!(a, [1, 6, -2]);
        assert!(!ReduceOp::<f32>::BitAnd.supported());
        assert!(ReduceOp::<u8>::BitAnd.supported());

        // Non-commutative: 2x2 matrix product stored as [a b c d].
        let matmul = ReduceOp::<i64>::custom(
            |acc, x| {
                let (a, b) = (acc.to_vec(), x);
                acc.copy_from_slice(&[
                    a[0] * b[0] + a[1] * b[2],
                    a[0] * b[1] + a[1] * b[3],
                    a[2] * b[0] + a[3] * b[2],
                    a[2] * b[1] + a[3] * b[3],
                ]);
            },
            false,
        );
        let r = matmul.erase();
        let (m1, m2) = ([1i64, 2, 3, 4], [0i64, 1, 1, 0]);
        let mut acc = bytemuck::cast_slice::<i64, u8>(&m1).to_vec();
        r.apply(&mut acc, bytemuck::cast_slice(&m2), false);
        assert_eq!(bytemuck::cast_slice::<u8, i64>(&acc), &[2, 1, 4, 3]); // m1 * m2
        let mut acc = bytemuck::cast_slice::<i64, u8>(&m1).to_vec();
        r.apply(&mut acc, bytemuck::cast_slice(&m2), true);
        assert_eq!(bytemuck::cast_slice::<u8, i64>(&acc), &[3, 4, 1, 2]); // m2 * m1
    }

    /// xorshift64: a fixed stream of test inputs.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// `r` is `exact` rounded to the nearest value of its type, ties to even: no neighbour of
    /// `r` is nearer, and on a tie `r`'s last significand bit is 0; infinite only beyond the
    /// largest finite value plus half its spacing (`overflow`). Values are compared in `f64`,
    /// which holds every half value and the exact sum or product of two `f16` values; for two
    /// `bf16` values it may round once, which does not change the rounding to 8 bits
    /// (53 ≥ 2·8 + 2).
    fn assert_nearest_even(exact: f64, r: f64, neighbours: (f64, f64), r_bits: u16, overflow: f64, what: &str) {
        if r.is_infinite() {
            assert!(exact.abs() >= overflow && exact.signum() == r.signum(), "{what}: {r} for {exact}");
            return;
        }
        let (below, above) = neighbours;
        let d = (exact - r).abs();
        assert!(d <= (exact - below).abs() && d <= (exact - above).abs(), "{what}: {r} is not nearest to {exact}");
        if d == (exact - below).abs().min((exact - above).abs()) && d != 0.0 {
            assert_eq!(r_bits & 1, 0, "{what}: a tie at {exact} not rounded to even ({r})");
        }
    }

    /// The value after and before `bits` in magnitude (same sign), as f64.
    fn neighbours(bits: u16, to_f64: impl Fn(u16) -> f64) -> (f64, f64) {
        let (up, down) = (to_f64(bits + 1), if bits & 0x7fff == 0 { -to_f64(bits | 1) } else { to_f64(bits - 1) });
        if to_f64(bits) < 0.0 { (up, down) } else { (down, up) }
    }

    /// Every pairwise step of `f16` and `bf16` is correctly rounded: `+` and `×` of random pairs
    /// of finite values (normal, subnormal, zero; results up to overflow) against the exact result.
    #[test]
    fn half_steps_are_correctly_rounded() {
        fn check<T: Element + std::fmt::Display>(
            next: &mut impl FnMut() -> u64,
            from_bits: fn(u16) -> T,
            to_bits: fn(T) -> u16,
            to_f64: fn(T) -> f64,
            overflow: f64,
        ) {
            for i in 0..200_000 {
                let (a, b) = (from_bits(next() as u16), from_bits(next() as u16));
                let (a64, b64) = (to_f64(a), to_f64(b));
                if !a64.is_finite() || !b64.is_finite() {
                    continue;
                }
                for (name, r, exact) in [("+", T::add(a, b), a64 + b64), ("*", T::mul(a, b), a64 * b64)] {
                    let bits = to_bits(r);
                    let near = neighbours(bits, |b| to_f64(from_bits(b)));
                    let what = format!("{} #{i} {a} {name} {b}", T::NAME);
                    assert_nearest_even(exact, to_f64(r), near, bits, overflow, &what);
                }
            }
        }
        let mut next = rng(0x5eed);
        // Overflow past the largest finite value plus half its spacing: 65504 + 16; 2^128 − 2^119.
        check(&mut next, f16::from_bits, f16::to_bits, f16::to_f64, 65520.0);
        check(&mut next, bf16::from_bits, bf16::to_bits, bf16::to_f64, 2f64.powi(128) - 2f64.powi(119));
        // Overflow and the special values behave as IEEE arithmetic.
        assert_eq!(f16::add(f16::MAX, f16::MAX), f16::INFINITY);
        assert!(f16::add(f16::INFINITY, f16::NEG_INFINITY).is_nan());
        assert_eq!(bf16::mul(bf16::MAX, bf16::from_f32(2.0)), bf16::INFINITY);
        assert!(f16::add(f16::NAN, f16::ONE).is_nan());
    }

    /// The block-wise slice operations give the bits of the element-wise ones, for lengths around
    /// the block size and for special values.
    #[test]
    fn half_slices_match_elements() {
        fn check<T: Element + std::fmt::Debug>(from_bits: fn(u16) -> T, to_bits: fn(T) -> u16, is_nan: fn(T) -> bool) {
            let mut next = rng(42);
            for len in [0, 1, 7, HALF_BLOCK - 1, HALF_BLOCK, HALF_BLOCK + 1, 3 * HALF_BLOCK + 5] {
                let mut acc: Vec<T> = (0..len).map(|_| from_bits(next() as u16)).collect();
                let x: Vec<T> = (0..len).map(|_| from_bits(next() as u16)).collect();
                for (op, name) in [(ReduceOp::Sum, "sum"), (ReduceOp::Product, "product")] {
                    let f = if name == "sum" { T::add } else { T::mul };
                    let want: Vec<T> = acc.iter().zip(&x).map(|(a, b)| f(*a, *b)).collect();
                    let mut got = acc.clone();
                    op.apply(&mut got, &x);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let same = to_bits(*g) == to_bits(*w) || (is_nan(*g) && is_nan(*w));
                        assert!(same, "{} {name} len {len} [{i}]: {g:?} vs {w:?}", T::NAME);
                    }
                }
                // Through the byte-erased reducer as the collectives run it.
                let want: Vec<T> = acc.iter().zip(&x).map(|(a, b)| T::add(*a, *b)).collect();
                let mut bytes = bytemuck::cast_slice::<T, u8>(&acc).to_vec();
                ReduceOp::<T>::Sum.erase().apply(&mut bytes, bytemuck::cast_slice(&x), false);
                let got: Vec<T> = bytemuck::pod_collect_to_vec(&bytes);
                assert!(got.iter().zip(&want).all(|(g, w)| to_bits(*g) == to_bits(*w) || (is_nan(*g) && is_nan(*w))));
                acc.truncate(len / 2);
                T::add_slice(&mut acc, &x); // a shorter accumulator: only the common length
            }
        }
        check(f16::from_bits, f16::to_bits, f16::is_nan);
        check(bf16::from_bits, bf16::to_bits, bf16::is_nan);
        let mut m = [f16::from_f32(1.0), f16::from_f32(-2.0), f16::NEG_ZERO];
        ReduceOp::Max.apply(&mut m, &[f16::from_f32(0.5), f16::from_f32(-1.0), f16::ZERO]);
        assert_eq!(m.map(f16::to_f32), [1.0, -1.0, 0.0]);
        assert!(!ReduceOp::<bf16>::BitXor.supported() && ReduceOp::<bf16>::LogicalXor.supported());
        let mut l = [bf16::ZERO, bf16::from_f32(3.0)];
        ReduceOp::LogicalOr.apply(&mut l, &[bf16::ZERO, bf16::ZERO]);
        assert_eq!(l, [bf16::ZERO, bf16::ONE]);
    }

    #[test]
    fn unaligned_bytes_are_handled() {
        let r = ReduceOp::<f64>::Sum.erase();
        let mut acc = [0u8; 17];
        acc[1..].copy_from_slice(bytemuck::cast_slice(&[1.5f64, 2.0]));
        let mut x = [0u8; 17];
        x[1..].copy_from_slice(bytemuck::cast_slice(&[1.0f64, 1.0]));
        r.apply(&mut acc[1..], &x[1..], false);
        let out: Vec<f64> = bytemuck::pod_collect_to_vec(&acc[1..]);
        assert_eq!(out, [2.5, 3.0]);
    }
}
