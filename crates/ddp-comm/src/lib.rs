//! Process groups for multi-process data-parallel training.
