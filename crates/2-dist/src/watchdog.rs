//! A watchdog for collectives that run on a device: NCCL has no timeout of its own, so a
//! rank whose peer hung or died would wait forever inside its stream. The watchdog thread
//! probes the rank's progress every tick; when work has been pending without progress for
//! longer than the timeout, or the probe reports a failure, it calls `abort` once (for NCCL:
//! `ncclCommAbort`, which makes the pending collectives return) and records why, so the
//! rank's blocked call returns an error that the caller can name ([`Watchdog::fired`]).
//!
//! The probe and the abort are the caller's: the trainer probes CUDA events recorded after
//! each step and NCCL's asynchronous error ([`crate::nccl::NcclAbort`]).

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The variable that sets the watchdog's timeout in seconds ([`timeout_from_env`]).
pub const TIMEOUT_ENV: &str = "CUDNN_CBR_DIST_TIMEOUT";

/// The timeout without [`TIMEOUT_ENV`]: long enough for the slowest single step of a large
/// network, as PyTorch's default for NCCL.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// [`TIMEOUT_ENV`] as a duration (whole or fractional seconds, > 0), else [`DEFAULT_TIMEOUT`].
///
/// # Errors
/// A message naming the variable for a value that is not a positive number of seconds.
pub fn timeout_from_env() -> Result<Duration, String> {
    parse_timeout(std::env::var(TIMEOUT_ENV).ok().as_deref())
}

/// [`timeout_from_env`] from the variable's value (`None`: unset).
///
/// # Errors
/// As [`timeout_from_env`].
pub fn parse_timeout(value: Option<&str>) -> Result<Duration, String> {
    match value {
        None => Ok(DEFAULT_TIMEOUT),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                format!("{TIMEOUT_ENV} is `{v}`; expected a positive number of seconds")
            }),
    }
}

/// What a probe saw since the last one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Some pending work finished.
    Advancing,
    /// Nothing is pending.
    Idle,
    /// Work is pending and none of it finished.
    Waiting,
    /// The backend reported an error (abort now).
    Failed(String),
}

#[derive(Default)]
struct State {
    stop: bool,
    fired: Option<String>,
}

/// A thread that aborts a stalled or failed group (module docs). Dropping it stops the
/// thread (within one tick).
pub struct Watchdog {
    shared: Arc<(Mutex<State>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    timeout: Duration,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("timeout", &self.timeout)
            .field("fired", &self.fired())
            .finish()
    }
}

impl Watchdog {
    /// Starts the thread: every `tick` it calls `probe`; after `timeout` of
    /// [`Health::Waiting`] with no [`Health::Advancing`] or [`Health::Idle`] in between, or at
    /// the first [`Health::Failed`], it calls `abort` with the reason, once, and stops.
    ///
    /// # Errors
    /// The OS refused the thread.
    pub fn spawn(
        timeout: Duration,
        tick: Duration,
        mut probe: impl FnMut() -> Health + Send + 'static,
        abort: impl FnOnce(&str) + Send + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let theirs = shared.clone();
        let thread = std::thread::Builder::new()
            .name("dist-watchdog".into())
            .spawn(move || {
                let (lock, wake) = &*theirs;
                let mut waiting_since: Option<Instant> = None;
                let mut state = lock.lock().unwrap_or_else(PoisonError::into_inner);
                loop {
                    state = wake
                        .wait_timeout(state, tick)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    if state.stop {
                        return;
                    }
                    // Probed without the lock held: a probe may take a while.
                    drop(state);
                    let reason = match probe() {
                        Health::Advancing | Health::Idle => {
                            waiting_since = None;
                            None
                        }
                        Health::Waiting => {
                            let since = *waiting_since.get_or_insert_with(Instant::now);
                            (since.elapsed() >= timeout).then(|| {
                                format!(
                                    "no collective or step finished for {:.1} s (timeout {:.1} s, \
                                     {TIMEOUT_ENV}): a peer hung or died",
                                    since.elapsed().as_secs_f64(),
                                    timeout.as_secs_f64()
                                )
                            })
                        }
                        Health::Failed(why) => Some(why),
                    };
                    state = lock.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(why) = reason {
                        if state.stop {
                            return;
                        }
                        abort(&why);
                        state.fired = Some(why);
                        return;
                    }
                }
            })?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
            timeout,
        })
    }

    /// Why the watchdog aborted the group, once it has.
    pub fn fired(&self) -> Option<String> {
        let (lock, _) = &*self.shared;
        lock.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .fired
            .clone()
    }

    /// The timeout it runs with.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, wake) = &*self.shared;
        lock.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
