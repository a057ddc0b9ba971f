//! Starts, watches and stops rank processes (the library behind `ddprun`).
//!
//! API CONTRACT (implementation pending — owner: store/launcher helper).
