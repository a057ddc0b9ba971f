//! Support code shared by the multi-process integration tests in `tests/`.
