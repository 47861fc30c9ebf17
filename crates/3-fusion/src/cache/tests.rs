//! Plan files: the fields, formats and ranges a file must have, and what is refused.

use super::*;

fn doc(text: &str) -> Map<String, Value> {
    match parse_strict_json(text).unwrap() {
        Value::Object(m) => m,
        _ => panic!("not an object"),
    }
}

const GOOD: &str = r#"{"format": "cudnn-cbr plan 2", "signature": "s", "target": "t",
    "graph": "g", "engine": 7, "knobs": [{"knob": 3, "value": 2}], "mode": "A",
    "config_index": 1}"#;

#[test]
fn a_plan_file_holds_an_engine_choice_and_nothing_else_is_accepted() {
    let stored = StoredPlan::parse(&doc(GOOD)).unwrap();
    assert_eq!(
        stored,
        StoredPlan {
            choice: EngineChoice {
                engine: 7,
                knobs: vec![KnobChoice { knob: 3, value: 2 }],
            },
            mode: Some(HeurMode::A),
            config_index: 1,
            tune: None,
        }
    );
    for (edit, needle) in [
        (
            ("\"format\": \"cudnn-cbr plan 2\", ", ""),
            "no `format` field",
        ),
        (("plan 2", "plan 1"), "unknown format"),
        (("\"engine\": 7", "\"engine\": -1"), "`engine`"),
        (("\"engine\": 7", "\"engine\": 1e30"), "`engine`"),
        (("\"engine\": 7", "\"engine\": \"7\""), "`engine`"),
        (("\"knob\": 3", "\"knob\": -3"), "knobs[0]"),
        (("\"knob\": 3", "\"knob\": 4294967296"), "knobs[0]"),
        (("\"value\": 2", "\"value\": 2.5"), "knobs[0]"),
        (("\"value\": 2}", "\"value\": 2, \"x\": 1}"), "knobs[0]"),
        (("\"mode\": \"A\"", "\"mode\": \"C\""), "`mode`"),
        (
            ("\"config_index\": 1", "\"config_index\": -1"),
            "`config_index`",
        ),
        // An earlier version's fields: what it ran is no longer taken from a file.
        (
            ("\"graph\": \"g\"", "\"graph\": \"g\", \"plan\": \"{}\""),
            "unknown field `plan`",
        ),
        (
            ("\"graph\": \"g\"", "\"graph\": \"g\", \"alpha\": 2.0"),
            "unknown field `alpha`",
        ),
        (("\"graph\": \"g\"", "\"graph\": 1"), "`graph`"),
        (
            (
                "\"config_index\": 1",
                "\"config_index\": 1, \"tune\": \"{}\"",
            ),
            "`tune`",
        ),
    ] {
        let text = GOOD.replacen(edit.0, edit.1, 1);
        assert_ne!(text, GOOD);
        let why = StoredPlan::parse(&doc(&text)).unwrap_err();
        assert!(why.contains(needle), "{edit:?}: {why}");
    }
    let many: Vec<String> = (0..=MAX_KNOBS)
        .map(|i| format!("{{\"knob\": {i}, \"value\": 0}}"))
        .collect();
    let text = GOOD.replacen(
        "[{\"knob\": 3, \"value\": 2}]",
        &format!("[{}]", many.join(",")),
        1,
    );
    assert!(StoredPlan::parse(&doc(&text))
        .unwrap_err()
        .contains("knobs"));
}

#[test]
fn a_tune_record_must_name_the_files_engine() {
    let tune = |engine: &str, index: usize| {
        GOOD.replacen(
            "\"config_index\": 1",
            &format!(
                "\"config_index\": 1, \"tune\": {{\"engine\": \"{engine}\", \"config_index\": {index}, \"time_ms\": 0.5, \"candidates\": []}}"
            ),
            1,
        )
    };
    let stored = StoredPlan::parse(&doc(&tune("eng7", 1))).unwrap();
    assert_eq!(stored.tune.unwrap().time_ms, 0.5);
    for text in [tune("eng8", 1), tune("eng7", 0)] {
        let why = StoredPlan::parse(&doc(&text)).unwrap_err();
        assert!(why.contains("the tune record names"), "{why}");
    }
}
