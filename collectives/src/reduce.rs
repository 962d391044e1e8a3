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

use std::sync::Arc;

use bytemuck::Pod;

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
        #[inline(always)]
        fn each<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
            acc.iter_mut().zip(x).for_each(|(a, b)| *a = f(*a, *b));
        }
        match self {
            ReduceOp::Sum => each(acc, x, T::add),
            ReduceOp::Product => each(acc, x, T::mul),
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
