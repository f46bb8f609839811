//! The meter a handler builds from the keys a layer's per-message rules found
//! ([`StreamKeys`], `layer/stream_keys.rs`).

use crate::layer::{Per, StreamKeys};

use super::meter::StreamMeterBuilder;

impl StreamKeys {
    /// A meter builder holding these keys and the rules' [`at_limit`](Self::at_limit): add
    /// keys of the handler's own (a per-stream key), grants ahead, and build.
    pub fn meter(&self) -> StreamMeterBuilder {
        let mut builder = super::StreamMeter::builder(&self.limiter);
        for (key, per, price) in &self.keys {
            builder = match (per, price) {
                (Per::Unit, Some(price)) => builder.per_unit_at(key.clone(), *price),
                (Per::Unit, None) => builder.per_unit(key.clone()),
                _ => builder.per_message(key.clone()),
            };
        }
        match self.at_limit {
            Some(at_limit) => builder.at_limit(at_limit),
            None => builder,
        }
    }
}
