//! The main job on the CPU executor gives the same bits whatever SIMD it may use
//! (`CUDNN_CBR_CPU_SIMD`: AVX-512 tiles and conversions, AVX2 ones, or the gather with the
//! `gemm` crate and `half`'s conversions), and a value it does not know is a typed error.
//! The cap is read once per process, so each run is a process of its own.

/// `train_cbr` on the CPU with `CUDNN_CBR_CPU_SIMD` set to `simd`: exit code and output.
fn run(simd: &str) -> (Option<i32>, String) {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let bin = [
        dir.join("../examples/train_cbr"),
        dir.join("example-train_cbr"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("train_cbr is built (`cargo build --workspace --examples`)");
    let out = std::process::Command::new(bin)
        .env("CUDNN_CBR_CPU_SIMD", simd)
        .args(["--device", "cpu", "--steps", "12"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

fn weights_hash(text: &str) -> String {
    let at = text
        .find("weights hash ")
        .unwrap_or_else(|| panic!("no weights hash in:\n{text}"));
    text[at + "weights hash ".len()..]
        .chars()
        .take_while(|c| c.is_ascii_hexdigit())
        .collect()
}

#[test]
fn every_simd_cap_trains_to_the_same_bits() {
    let mut hashes = Vec::new();
    for simd in ["avx512", "avx2", "portable"] {
        let (code, text) = run(simd);
        assert_eq!(code, Some(0), "CUDNN_CBR_CPU_SIMD={simd}:\n{text}");
        // The first line names the paths the cap left (e.g. "portable FP16 conversions").
        if simd == "portable" {
            assert!(text.contains("portable FP16 conversions"), "{text}");
        }
        hashes.push((simd, weights_hash(&text)));
    }
    assert!(
        hashes.iter().all(|(_, h)| *h == hashes[0].1),
        "weights hashes by cap: {hashes:?}"
    );
}

#[test]
fn an_unknown_simd_cap_is_refused_naming_the_variable() {
    let (code, text) = run("sse9");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("CUDNN_CBR_CPU_SIMD") && text.contains("sse9"),
        "{text}"
    );
}
