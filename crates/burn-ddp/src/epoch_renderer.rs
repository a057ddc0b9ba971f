//! [`EpochLineRenderer`]: burn-train's metrics as one plain line per epoch and split, for the
//! console of rank 0 (the other ranks take [`crate::SilentRenderer`]).
//!
//! Without its `tui` feature burn-train prints a debug line per step; with it, a full-screen
//! interface that several ranks cannot share and a log file cannot hold. This renderer prints
//! what a training log needs, once per split: the epoch, the split, and each metric's running
//! value over the epoch.

use std::collections::HashMap;

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// Prints one line per epoch and split (`train`, `valid`) with every metric's value over the
/// epoch so far, e.g. `epoch 3/10 train: Loss 0.412, Accuracy 87.5 %`, and the summary at the
/// end. Give it to rank 0 with `SupervisedTraining::renderer`.
#[derive(Debug, Default)]
pub struct EpochLineRenderer {
    names: HashMap<MetricId, String>,
    /// The metrics of the split under way, in the order they were first seen.
    values: Vec<(MetricId, String)>,
    epoch: usize,
    epochs: usize,
    split: String,
}

impl EpochLineRenderer {
    /// A renderer that has printed nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn record(&mut self, state: MetricState) {
        let entry = match state {
            MetricState::Generic(e) | MetricState::Numeric(e, _) => e,
        };
        let value = epoch_value(&entry.serialized_entry.formatted);
        match self
            .values
            .iter_mut()
            .find(|(id, _)| *id == entry.metric_id)
        {
            Some((_, v)) => *v = value,
            None => self.values.push((entry.metric_id, value)),
        }
    }

    /// The line of the split just ended.
    fn line(&self) -> String {
        let metrics = self
            .values
            .iter()
            .map(|(id, v)| {
                let name = self.names.get(id).map_or("metric", String::as_str);
                format!("{name} {v}")
            })
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "epoch {}/{} {}: {metrics}",
            self.epoch, self.epochs, self.split
        )
    }
}

/// The epoch's running value in burn-train's `epoch X unit - batch Y unit` text (the whole text
/// when it has another form).
fn epoch_value(formatted: &str) -> String {
    formatted
        .strip_prefix("epoch ")
        .and_then(|rest| rest.split(" - batch").next())
        .unwrap_or(formatted)
        .trim()
        .to_string()
}

/// Prints burn-train's summary, when it made one (`SupervisedTraining::summary`).
fn print_summary(summary: Option<LearnerSummary>) -> Result<(), Box<dyn core::error::Error>> {
    if let Some(summary) = summary {
        println!("{summary}");
    }
    Ok(())
}

impl MetricsRendererTraining for EpochLineRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.record(state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.record(state);
    }
    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        print_summary(summary)
    }
}

impl MetricsRendererEvaluation for EpochLineRenderer {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.record(state);
    }
    fn on_test_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        print_summary(summary)
    }
}

impl TrainingProgressLogger for EpochLineRenderer {
    fn start(&mut self, epochs: usize, starting_epoch: usize, _: Option<usize>, _: Option<&str>) {
        self.epochs = epochs;
        self.epoch = starting_epoch;
    }
    /// burn-train calls it when epoch `epoch` has ended.
    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }
    fn start_split(&mut self, split: &str, _total_items: usize) {
        self.split = split.to_string();
        self.values.clear();
    }
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {
        println!("{}", self.line());
    }
    fn end(&mut self) {}
    /// burn-train's events are one per step ("Iteration"): not for this log.
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for EpochLineRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, name: &str, _total_items: usize) {
        self.split = name.to_string();
        self.values.clear();
    }
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {
        println!("{}: {}", self.split, self.line());
    }
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for EpochLineRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id, definition.name.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_value_is_read_from_burn_trains_text() {
        assert_eq!(epoch_value("epoch 0.412 - batch 0.398"), "0.412");
        assert_eq!(epoch_value("epoch 87.500 % - batch 90.000 %"), "87.500 %");
        assert_eq!(epoch_value("something else"), "something else");
    }
}
