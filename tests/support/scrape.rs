//! A Prometheus text exposition, parsed by `prometheus-parse`: value by
//! `name{label=value,...}` (labels sorted; a histogram's value is its count).
#![allow(dead_code)]

use std::collections::HashMap;

pub fn samples(text: &str) -> HashMap<String, f64> {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("Prometheus text format");
    let mut values = HashMap::new();
    for s in scrape.samples {
        let mut labels: Vec<(String, String)> = s
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.sort();
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(h) => h.iter().map(|b| b.count).fold(0.0, f64::max),
            prometheus_parse::Value::Summary(_) => f64::NAN,
        };
        values.insert(format!("{}{{{}}}", s.metric, labels.join(",")), value);
    }
    values
}
