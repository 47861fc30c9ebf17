//! Bad inputs: plan-cache folders others could write (recoveries: memory-only, with the reason).

use super::*;

pub(super) fn cache_folder_refused(tag: &str, mode: u32, needle: &str) -> Verdict {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(cache.dir(), None);
    let why = cache.refused().expect("a reason").to_string();
    assert!(why.contains(needle), "{why}");
    Verdict::Recovered(format!("memory-only: {why}"))
}

pub(super) fn cache_folder_rows() -> Vec<Row> {
    vec![
        ("plan cache", "a folder its group can write (0770)", || {
            cache_folder_refused("mode770", 0o770, "writable by its group (mode 770)")
        }),
        ("plan cache", "a folder anyone can write (0777)", || {
            cache_folder_refused("mode777", 0o777, "writable by its group and others")
        }),
        (
            "plan cache",
            "a folder others can write, sticky (1777)",
            || cache_folder_refused("mode1777", 0o1777, "writable by its group and others"),
        ),
        (
            "plan cache",
            "a private folder inside one anyone can write",
            || {
                use std::os::unix::fs::PermissionsExt;
                let open = scratch("open-parent");
                std::fs::create_dir_all(&open).unwrap();
                std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
                let cache = PlanCache::persistent(open.join("plans")).unwrap();
                let _ = std::fs::remove_dir_all(&open);
                assert_eq!(cache.dir(), None);
                let why = cache.refused().expect("a reason").to_string();
                assert!(
                    why.contains("open-parent is writable by its group and others"),
                    "{why}"
                );
                Verdict::Recovered(format!("memory-only: {why}"))
            },
        ),
    ]
}
