//! Counting and reading a network's parameters (to compare with PyTorch's count and to
//! compare two runs).

use burn::module::Module;
use burn::tensor::Tensor;

/// The number of trainable parameters of `model`: its values without the norm layers' running
/// statistics (`running_mean`, `running_var`), which Burn's `num_params` counts and PyTorch
/// keeps as buffers.
pub fn trainable_params<M: Module>(model: &M) -> usize {
    /// The names of the fields entered so far; a value's own field name is the last one.
    #[derive(Default)]
    struct Count {
        path: Vec<String>,
        total: usize,
    }
    impl burn::module::ModuleVisitor for Count {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let buffer = self
                .path
                .last()
                .is_some_and(|name| name == "running_mean" || name == "running_var");
            if !buffer {
                self.total += param.shape().num_elements();
            }
        }
    }
    let mut count = Count::default();
    model.visit(&mut count);
    count.total
}

/// Every parameter value of `model` in visit order, as f32 (to compare two runs).
pub fn parameter_values<M: Module>(model: &M) -> Vec<f32> {
    #[derive(Default)]
    struct Collect(Vec<f32>);
    impl burn::module::ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.extend(data.try_to_vec::<f32>().unwrap_or_default());
        }
    }
    let mut c = Collect::default();
    model.visit(&mut c);
    c.0
}
