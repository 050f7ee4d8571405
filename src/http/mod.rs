//! The HTTP door: a tower layer that runs each keyed request through the
//! protocol.

pub(crate) mod buffer;
pub(crate) mod future;
pub(crate) mod handler;
pub(crate) mod keyed;
pub(crate) mod layer;
pub(crate) mod observe;
pub(crate) mod outcome;
pub(crate) mod problem;
pub(crate) mod rejection;
pub(crate) mod scope;
pub(crate) mod service;
pub(crate) mod shared;
pub(crate) mod store_policy;
