//! Draws from a seeded generator whose values this crate fixes, not rand's version.
//!
//! A seed must give the same reference data (whose files are committed byte for byte), the same
//! message sets and the same nemesis schedules on every build. rand keeps a generator's stream
//! from one release to the next, but not the values its distributions make of that stream: the
//! uniform and Bernoulli draws changed between 0.8 and 0.9. The draws here are rand 0.8's,
//! with which the committed reference data was generated, over any [`rand::Rng`].

use std::ops::{Range, RangeInclusive};

use rand::Rng;

/// An integer type a range of which can be drawn from uniformly.
pub trait Uniform: Copy {
    /// A uniform draw of `low..=high` (`low <= high`): widening multiply with rejection, as
    /// rand 0.8's `UniformInt::sample_single_inclusive`.
    fn draw_inclusive<R: Rng + ?Sized>(rng: &mut R, low: Self, high: Self) -> Self;
    /// The value before `self`, the last of a half-open range that ends at `self`.
    fn before(self) -> Self;
}

macro_rules! uniform {
    ($ty:ty, $unsigned:ty, $large:ty, $next:ident, $product:ident) => {
        impl Uniform for $ty {
            fn draw_inclusive<R: Rng + ?Sized>(rng: &mut R, low: Self, high: Self) -> Self {
                let range = high.wrapping_sub(low).wrapping_add(1) as $unsigned as $large;
                if range == 0 {
                    // The type's whole range.
                    return $next(rng) as $ty;
                }
                // The largest multiple of `range`, less one, that fits: exact for types of 16
                // bits or fewer, a conservative bound for wider ones.
                let zone = if <$unsigned>::BITS <= 16 {
                    let max = <$large>::MAX;
                    max - (max - range + 1) % range
                } else {
                    (range << range.leading_zeros()).wrapping_sub(1)
                };
                loop {
                    let (high_part, low_part) = $product($next(rng), range);
                    if low_part <= zone {
                        return low.wrapping_add(high_part as $ty);
                    }
                }
            }

            fn before(self) -> Self {
                self - 1
            }
        }
    };
}

// The types the generators draw. A value is drawn as rand 0.8 draws the wider type: one word of
// 32 bits, one of 64, or for 128 bits two of 64, the low one first.
uniform!(u8, u8, u32, next_32, product_32);
uniform!(u32, u32, u32, next_32, product_32);
uniform!(i32, u32, u32, next_32, product_32);
uniform!(u64, u64, u64, next_64, product_64);
uniform!(i64, u64, u64, next_64, product_64);
uniform!(usize, usize, u64, next_64, product_64);
uniform!(i128, u128, u128, next_128, product_128);

fn next_32<R: Rng + ?Sized>(rng: &mut R) -> u32 {
    rng.next_u32()
}

fn next_64<R: Rng + ?Sized>(rng: &mut R) -> u64 {
    rng.next_u64()
}

fn next_128<R: Rng + ?Sized>(rng: &mut R) -> u128 {
    let low = u128::from(rng.next_u64());
    low | u128::from(rng.next_u64()) << 64
}

/// `a × b` as its high and low 32 bits.
fn product_32(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// `a × b` as its high and low 64 bits.
fn product_64(a: u64, b: u64) -> (u64, u64) {
    let product = u128::from(a) * u128::from(b);
    ((product >> 64) as u64, product as u64)
}

/// `a × b` as its high and low 128 bits.
fn product_128(a: u128, b: u128) -> (u128, u128) {
    const LOW: u128 = u64::MAX as u128;
    let (a_high, a_low) = (a >> 64, a & LOW);
    let (b_high, b_low) = (b >> 64, b & LOW);
    let (low_low, low_high) = (a_low * b_low, a_low * b_high);
    let (high_low, high_high) = (a_high * b_low, a_high * b_high);
    let middle = (low_low >> 64) + (low_high & LOW) + (high_low & LOW);
    let low = (low_low & LOW) | (middle << 64);
    let high = high_high + (low_high >> 64) + (high_low >> 64) + (middle >> 64);
    (high, low)
}

/// A range to draw from: `low..high` (not empty) or `low..=high`.
pub trait DrawRange<T> {
    /// Its first and last values.
    fn bounds(self) -> (T, T);
}

impl<T: Uniform + PartialOrd> DrawRange<T> for Range<T> {
    fn bounds(self) -> (T, T) {
        assert!(self.start < self.end, "cannot draw from an empty range");
        (self.start, self.end.before())
    }
}

impl<T: Uniform + PartialOrd> DrawRange<T> for RangeInclusive<T> {
    fn bounds(self) -> (T, T) {
        let (low, high) = self.into_inner();
        assert!(low <= high, "cannot draw from an empty range");
        (low, high)
    }
}

/// The draws, on every generator.
pub trait Draws: Rng {
    /// A value of `range`, uniformly.
    fn draw<T: Uniform>(&mut self, range: impl DrawRange<T>) -> T {
        let (low, high) = range.bounds();
        T::draw_inclusive(self, low, high)
    }

    /// `true` with probability `p` (0 to 1), as rand 0.8's `Bernoulli`.
    fn draw_bool(&mut self, p: f64) -> bool {
        assert!((0.0..=1.0).contains(&p), "a probability is from 0 to 1");
        if p >= 1.0 {
            return true;
        }
        // 2^64 as a float: `p` scaled to the range of a u64.
        const SCALE: f64 = 2.0 * (1_u64 << 63) as f64;
        self.next_u64() < (p * SCALE) as u64
    }

    /// `items` in a uniformly random order (Fisher–Yates from the end), as rand 0.8's
    /// `SliceRandom::shuffle`.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for last in (1..items.len()).rev() {
            // rand 0.8 draws an index below 2^32 as a u32.
            let other = match u32::try_from(last + 1) {
                Ok(bound) => self.draw(0..bound) as usize,
                Err(_) => self.draw(0..last + 1),
            };
            items.swap(last, other);
        }
    }
}

impl<R: Rng + ?Sized> Draws for R {}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// What rand 0.8.5 drew from `ChaCha8Rng::seed_from_u64(7)` (rand_chacha 0.3), recorded
    /// with that version: the draws here, on today's rand, must give the same.
    #[test]
    fn the_draws_are_those_of_rand_0_8() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let small: Vec<u8> = (0..8).map(|_| rng.draw(0..26_u8)).collect();
        let index: Vec<usize> = (0..4).map(|_| rng.draw(0..1_000_usize)).collect();
        let days: Vec<i32> = (0..4).map(|_| rng.draw(5..340)).collect();
        let qty: Vec<u64> = (0..4).map(|_| rng.draw(1_000..=100_000_u64)).collect();
        let coins: Vec<bool> = (0..8).map(|_| rng.draw_bool(0.3)).collect();
        let prices: Vec<i128> = (0..4).map(|_| rng.draw(10_000_i128..5_000_000)).collect();
        let mut order: Vec<u32> = (0..10).collect();
        rng.shuffle(&mut order);
        assert_eq!(
            format!("{small:?} {index:?} {days:?} {qty:?} {coins:?} {prices:?} {order:?}"),
            RAND_0_8_DRAWS
        );
    }

    const RAND_0_8_DRAWS: &str = "[3, 4, 4, 4, 7, 18, 0, 18] [601, 359, 83, 849] \
        [125, 127, 170, 336] [20823, 39043, 52604, 26473] \
        [false, false, false, true, false, true, false, false] \
        [401969, 4885755, 2585569, 202115] [2, 9, 0, 6, 7, 4, 3, 1, 5, 8]";

    #[test]
    fn the_128_bit_product_is_the_product() {
        for (a, b) in [
            (u128::MAX, u128::MAX),
            (u128::MAX, 2),
            (1 << 64, 1 << 64),
            (12345, 678),
        ] {
            let (high, low) = product_128(a, b);
            // Checked against the product of the halves as a 256-bit sum, four 64-bit limbs.
            let limbs = |x: u128| [x as u64 as u128, x >> 64];
            let mut sum = [0_u128; 4];
            for (i, x) in limbs(a).iter().enumerate() {
                for (j, y) in limbs(b).iter().enumerate() {
                    let product = x * y;
                    sum[i + j] += product & u128::from(u64::MAX);
                    sum[i + j + 1] += product >> 64;
                }
            }
            for k in 0..3 {
                sum[k + 1] += sum[k] >> 64;
                sum[k] &= u128::from(u64::MAX);
            }
            assert_eq!(
                (high, low),
                (sum[3] << 64 | sum[2], sum[1] << 64 | sum[0]),
                "{a} {b}"
            );
        }
    }

    #[test]
    fn every_value_of_a_small_range_is_drawn_and_none_outside_it() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut seen = [0_u32; 7];
        for _ in 0..7_000 {
            let value: u8 = rng.draw(3..=9_u8);
            seen[usize::from(value - 3)] += 1;
        }
        assert!(
            seen.iter().all(|count| (800..1200).contains(count)),
            "{seen:?}"
        );
        assert!(rng.draw_bool(1.0));
        assert!(!rng.draw_bool(0.0));
    }
}
