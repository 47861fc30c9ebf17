//! The device collectives' watchdog (no GPU): it aborts once after the timeout of pending
//! work without progress, or at once on a reported failure; never while work advances; and
//! stops when dropped.

use cudnn_cbr_dist::watchdog::{parse_timeout, Health, Watchdog, DEFAULT_TIMEOUT};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TICK: Duration = Duration::from_millis(10);

/// Waits up to `limit` for the watchdog to fire.
fn fired_within(w: &Watchdog, limit: Duration) -> Option<String> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(why) = w.fired() {
            return Some(why);
        }
        std::thread::sleep(TICK);
    }
    None
}

fn counter() -> (Arc<AtomicUsize>, impl FnOnce(&str) + Send + 'static) {
    let n = Arc::new(AtomicUsize::new(0));
    let theirs = n.clone();
    (n, move |_: &str| {
        theirs.fetch_add(1, Ordering::SeqCst);
    })
}

#[test]
fn pending_work_without_progress_is_aborted_once_after_the_timeout() {
    let (aborts, abort) = counter();
    let start = Instant::now();
    let timeout = Duration::from_millis(150);
    let w = Watchdog::spawn(timeout, TICK, || Health::Waiting, abort).unwrap();
    let why = fired_within(&w, Duration::from_secs(5)).expect("fires");
    assert!(start.elapsed() >= timeout, "{:?}", start.elapsed());
    assert!(why.contains("no collective or step finished"), "{why}");
    assert!(why.contains("CUDNN_CBR_DIST_TIMEOUT"), "{why}");
    std::thread::sleep(5 * TICK);
    assert_eq!(aborts.load(Ordering::SeqCst), 1);
}

#[test]
fn work_that_advances_is_never_aborted() {
    let (aborts, abort) = counter();
    // Progress every fourth probe (about every 40 ms), far inside a 1 s timeout (the margin
    // absorbs a loaded machine's late ticks), for over twice the timeout; then idle.
    let probes = Arc::new(Mutex::new(0usize));
    let seen = probes.clone();
    let w = Watchdog::spawn(
        Duration::from_secs(1),
        TICK,
        move || {
            let mut n = seen.lock().unwrap();
            *n += 1;
            match *n {
                n if n > 200 => Health::Idle,
                n if n % 4 == 0 => Health::Advancing,
                _ => Health::Waiting,
            }
        },
        abort,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(w.fired(), None);
    assert_eq!(aborts.load(Ordering::SeqCst), 0);
    assert!(
        *probes.lock().unwrap() > 20,
        "the watchdog probes every tick"
    );
}

#[test]
fn a_reported_failure_aborts_at_once_with_its_message() {
    let (aborts, abort) = counter();
    let w = Watchdog::spawn(
        Duration::from_secs(3600),
        TICK,
        || Health::Failed("ncclRemoteError: peer 3 closed".into()),
        abort,
    )
    .unwrap();
    let why = fired_within(&w, Duration::from_secs(5)).expect("fires");
    assert_eq!(why, "ncclRemoteError: peer 3 closed");
    assert_eq!(aborts.load(Ordering::SeqCst), 1);
}

#[test]
fn dropping_the_watchdog_stops_it_without_aborting() {
    let (aborts, abort) = counter();
    let w = Watchdog::spawn(Duration::from_millis(50), TICK, || Health::Waiting, abort).unwrap();
    let start = Instant::now();
    drop(w);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(aborts.load(Ordering::SeqCst), 0);
}

#[test]
fn the_timeout_variable_takes_positive_seconds() {
    assert_eq!(parse_timeout(None).unwrap(), DEFAULT_TIMEOUT);
    assert_eq!(parse_timeout(Some("30")).unwrap(), Duration::from_secs(30));
    assert_eq!(
        parse_timeout(Some(" 0.5 ")).unwrap(),
        Duration::from_millis(500)
    );
    for bad in ["0", "-3", "soon", "inf", ""] {
        let e = parse_timeout(Some(bad)).unwrap_err();
        assert!(e.contains("CUDNN_CBR_DIST_TIMEOUT"), "{e}");
    }
}
