//! ferrocomm: async communication for programs made of many cooperating processes.
pub mod error;
pub mod p2p;
pub use error::{Error, Result};
