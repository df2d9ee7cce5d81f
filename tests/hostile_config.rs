//! Hostile configs are errors naming the key, never panics or huge allocations: sizes that wrap
//! or pass their limits, non-finite or out-of-range floats, and chunk sizes past the limit.

mod common;

use candle_core::{Device, Result, Tensor};
use common::hostile::{assert_contains, config_err, err, fixture, g1_config, load, Tmp, G1};
use mamba2::model::Config;

#[test]
fn config_sizes_that_would_wrap_are_refused() {
    // 2^32·2^32 = 2^64 wraps to 0 in a release build: both sides of num_heads·head_dim =
    // expand·hidden_size would be 0 and pass an unchecked comparison.
    let big = 1u64 << 32;
    let msg = config_err(&format!(
        r#"{{"hidden_size": {big}, "expand": {big}, "num_heads": {big}, "head_dim": {big},
            "n_groups": 1}}"#
    ));
    assert_contains(
        &msg,
        "hidden_size = 4294967296 is above the limit of 1048576",
    );
    // Every dimension in range, their products not: named with the product, its value and the
    // i32 limit.
    for (json, needle) in [
        (
            r#"{"hidden_size": 1048576, "expand": 4096, "num_heads": 65536, "head_dim": 65536}"#,
            "expand·hidden_size = 4096·1048576 = 4294967296 is above the limit of 2147483647 elements",
        ),
        (
            r#"{"hidden_size": 4096, "expand": 1, "num_heads": 1024, "head_dim": 4,
                "n_groups": 1024, "state_size": 1048576}"#,
            "conv_dim = d_inner + 2·n_groups·state_size = 4096 + 2·1073741824 = 2147487744 is above",
        ),
        (
            r#"{"hidden_size": 524288, "expand": 2, "num_heads": 1048576, "head_dim": 1,
                "n_groups": 1048576, "state_size": 1048576}"#,
            "n_groups·state_size = 1048576·1048576 = 1099511627776 is above the limit",
        ),
        (
            r#"{"hidden_size": 4096, "vocab_size": 1048576, "num_heads": 128, "head_dim": 64}"#,
            "embedding = vocab_size·hidden_size = 1048576·4096 = 4294967296 is above the limit",
        ),
        (
            r#"{"hidden_size": 65536, "expand": 2, "num_heads": 2048, "head_dim": 64,
                "vocab_size": 16}"#,
            "in_proj weight = in_proj rows·hidden_size",
        ),
        (
            r#"{"hidden_size": 1024, "expand": 2, "num_heads": 32, "head_dim": 64,
                "n_groups": 1, "state_size": 1048576, "vocab_size": 16}"#,
            "is above the limit of 2147483647 elements",
        ),
        (
            r#"{"d_model": 1048576, "ssm_cfg": {"layer": "Mamba2", "expand": 4096}}"#,
            "ssm_cfg.expand·d_model = 4096·1048576 = 4294967296 is above the limit",
        ),
        (
            r#"{"d_model": 64, "vocab_size": 18446744073709551615, "ssm_cfg": {"layer": "Mamba2"}}"#,
            "vocab_size = 18446744073709551615 is above the limit of 1048576",
        ),
    ] {
        assert_contains(&config_err(json), needle);
    }
    // A Config built in code saturates instead of wrapping, and validate names the key.
    let half = 1usize << (usize::BITS / 2);
    let valid = Config::from_json(r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1}"#)
        .expect("valid config");
    let wrapped = Config {
        nheads: half,
        headdim: half,
        expand: half,
        d_model: half,
        ..valid
    };
    assert_eq!(wrapped.d_inner(), usize::MAX);
    assert_eq!(wrapped.conv_dim(), usize::MAX);
    assert_contains(
        &err(wrapped.validate()),
        &format!("hidden_size = {half} is above the limit"),
    );
}

#[test]
fn config_dimensions_above_their_limits_are_refused() {
    let over = Config::MAX_DIM + 1;
    for (key, value, limit) in [
        ("hidden_size", over, Config::MAX_DIM),
        (
            "num_hidden_layers",
            Config::MAX_LAYERS + 1,
            Config::MAX_LAYERS,
        ),
        ("vocab_size", over, Config::MAX_DIM),
        ("state_size", over, Config::MAX_DIM),
        ("conv_kernel", over, Config::MAX_DIM),
        ("expand", over, Config::MAX_DIM),
        ("head_dim", over, Config::MAX_DIM),
        ("num_heads", over, Config::MAX_DIM),
        ("n_groups", over, Config::MAX_DIM),
        (
            "chunk_size",
            Config::MAX_CHUNK_SIZE + 1,
            Config::MAX_CHUNK_SIZE,
        ),
    ] {
        assert_contains(
            &config_err(&g1_config(key, &value.to_string())),
            &format!("{key} = {value} is above the limit of {limit}"),
        );
        assert_contains(
            &config_err(&g1_config(key, "0")),
            &format!("{key} must be >= 1, got 0"),
        );
    }
    let original =
        |ssm: &str| format!(r#"{{"d_model": 64, "ssm_cfg": {{"layer": "Mamba2", {ssm}}}}}"#);
    assert_contains(
        &config_err(&original(r#""d_state": 1048577"#)),
        "ssm_cfg.d_state = 1048577 is above the limit of 1048576",
    );
    assert_contains(
        &config_err(&original(r#""chunk_size": 65537"#)),
        "ssm_cfg.chunk_size = 65537 is above the limit of 65536",
    );
    assert_contains(
        &config_err(r#"{"d_model": 64, "n_layer": 65537, "ssm_cfg": {"layer": "Mamba2"}}"#),
        "n_layer = 65537 is above the limit of 65536",
    );
}

#[test]
fn non_finite_and_out_of_range_floats_are_refused() {
    let eps = "layer_norm_epsilon must be finite, > 0 and <= 1, got";
    for (value, shown) in [
        ("NaN", "NaN"),
        ("Infinity", "inf"),
        ("-Infinity", "-inf"),
        (r#"{"__float__": "NaN"}"#, "NaN"),
        ("1e300", "1e300"),
        ("2.0", "2.0"),
        ("0.0", "0.0"),
        ("-1e-5", "-1e-5"),
    ] {
        assert_contains(
            &config_err(&g1_config("layer_norm_epsilon", value)),
            &format!("{eps} {shown}"),
        );
    }
    for value in ["1.0", "1e-12"] {
        Config::from_json(&g1_config("layer_norm_epsilon", value)).expect("eps in range");
    }
    let limit = "time_step_limit must be [lo, hi] with lo finite and >= 0, hi > 0 and >= lo (hi \
                 may be Infinity), got";
    for (value, shown) in [
        ("[Infinity, Infinity]", "[inf, inf]"),
        ("[NaN, 1.0]", "[NaN, 1.0]"),
        ("[0.0, NaN]", "[0.0, NaN]"),
        ("[-1.0, 1.0]", "[-1.0, 1.0]"),
        ("[-Infinity, 1.0]", "[-inf, 1.0]"),
        ("[0.5, 0.1]", "[0.5, 0.1]"),
        ("[0.0, 0.0]", "[0.0, 0.0]"),
        ("[1e300, Infinity]", "[inf, inf]"),
    ] {
        assert_contains(
            &config_err(&g1_config("time_step_limit", value)),
            &format!("{limit} {shown}"),
        );
    }
    for value in [
        "[0.0, Infinity]",
        "[0.001, 0.1]",
        "[0.1, 0.1]",
        "[0.0, 1e300]",
    ] {
        Config::from_json(&g1_config("time_step_limit", value)).expect("limit in range");
    }
    assert_contains(
        &config_err(r#"{"d_model": 64, "ssm_cfg": {"layer": "Mamba2", "dt_limit": [NaN, 1.0]}}"#),
        "ssm_cfg.dt_limit must be [lo, hi]",
    );
}

#[test]
fn oversized_chunk_size_is_refused_and_the_scan_chunk_is_clamped() -> Result<()> {
    let tmp = Tmp::new("chunk");
    std::fs::copy(
        fixture(G1).join("model.safetensors"),
        tmp.path("model.safetensors"),
    )?;
    let ids = Tensor::new(
        &[[3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]],
        &Device::Cpu,
    )?;
    let mut want = None;
    // Every chunk_size up to the limit runs (chunks of 16 to 256 tokens) with the same logits.
    for chunk in [1, 8, 17, 300, 4096, Config::MAX_CHUNK_SIZE] {
        std::fs::write(
            tmp.path("config.json"),
            g1_config("chunk_size", &chunk.to_string()),
        )?;
        let model = load(&tmp.0)?;
        let logits = model.forward(&ids, &mut model.new_cache(1)?)?;
        let want = want.get_or_insert(logits.clone());
        let diff: f32 = (logits - &*want)?.abs()?.max_all()?.to_scalar()?;
        assert!(diff < 1e-4, "chunk_size {chunk}: logits differ by {diff}");
    }
    std::fs::write(tmp.path("config.json"), g1_config("chunk_size", "65537"))?;
    assert_contains(
        &err(load(&tmp.0)),
        "chunk_size = 65537 is above the limit of 65536",
    );
    Ok(())
}
