//! `cargo xtask …`: the project's task runner.
fn main() {
    eprintln!("xtask: no commands yet");
    std::process::exit(2);
}
