//! [`Launchers`]: `ddprun` processes a test started, killed and reaped however the test ends.

use std::process::Child;

/// Launchers of a test: SIGKILLed and reaped when dropped, however the test ends (their ranks
/// die with them through PDEATHSIG).
pub struct Launchers(pub Vec<Child>);

impl Drop for Launchers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
