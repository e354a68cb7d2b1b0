//! The protobuf codec of every Sluice gRPC service and client: prost's, except
//! that bytes that are not a valid message answer `INVALID_ARGUMENT` (the
//! caller sent something wrong; retrying it will not help) instead of
//! `INTERNAL`, which reads as a fault of the server.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Code, Status};
use tonic_prost::{ProstDecoder, ProstEncoder};

#[derive(Debug, Clone)]
pub struct SluiceCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for SluiceCodec<T, U> {
    fn default() -> Self {
        SluiceCodec { _types: PhantomData }
    }
}

impl<T, U> Codec for SluiceCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = SluiceDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        SluiceDecoder {
            inner: ProstDecoder::default(),
        }
    }
}

/// Decodes like prost; undecodable bytes are `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct SluiceDecoder<U> {
    inner: ProstDecoder<U>,
}

impl<U: prost::Message + Default> Decoder for SluiceDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Self::Error> {
        self.inner.decode(buf).map_err(|status| {
            if status.code() == Code::Internal {
                Status::invalid_argument(format!(
                    "the message is not a valid protobuf message of the expected type: {}",
                    status.message()
                ))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}
