//! The storage types the backend runs in on the device (f32, bf16, f16): the `#define` each
//! puts ahead of the kernel source, the ones and zeros cuBLAS scales by, and conversions from
//! the host copy of the weights and to and from little-endian bytes (KV blocks in transit).

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::model::weights::le_vec;
use crate::model::{DType, Host};

/// A storage type on the device.
pub trait DevFloat: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    const DEFINE: &'static str;
    const DTYPE: DType;
    fn one() -> Self;
    fn zero() -> Self;
    fn from_host(h: &Host) -> Vec<Self>;
    fn to_le(x: &[Self]) -> Vec<u8>;
    fn from_le(b: &[u8]) -> Vec<Self>;
}

impl DevFloat for f32 {
    const DEFINE: &'static str = "#define DT_F32\n";
    const DTYPE: DType = DType::F32;
    fn one() -> Self {
        1.0
    }
    fn zero() -> Self {
        0.0
    }
    fn from_host(h: &Host) -> Vec<Self> {
        h.to_f32()
    }
    fn to_le(x: &[Self]) -> Vec<u8> {
        bytemuck::cast_slice(x).to_vec()
    }
    fn from_le(b: &[u8]) -> Vec<Self> {
        le_vec(b)
    }
}

macro_rules! half_float {
    ($t:ty, $define:expr, $dtype:expr, $variant:ident) => {
        impl DevFloat for $t {
            const DEFINE: &'static str = $define;
            const DTYPE: DType = $dtype;
            fn one() -> Self {
                <$t>::ONE
            }
            fn zero() -> Self {
                <$t>::ZERO
            }
            fn from_host(h: &Host) -> Vec<Self> {
                match h {
                    Host::$variant(v) => v.clone(),
                    other => other.to_f32().into_iter().map(<$t>::from_f32).collect(),
                }
            }
            fn to_le(x: &[Self]) -> Vec<u8> {
                bytemuck::cast_slice(x).to_vec()
            }
            fn from_le(b: &[u8]) -> Vec<Self> {
                le_vec(b)
            }
        }
    };
}

half_float!(bf16, "#define DT_BF16\n", DType::Bf16, Bf16);
half_float!(f16, "#define DT_F16\n", DType::F16, F16);
