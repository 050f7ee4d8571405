//! Whether stored bodies are compressed, and the zstd frames they become.
//!
//! Without the `compression` feature a store writes bodies as they are, and
//! reading a compressed one is a clear error rather than garbage. With it, a
//! store given [`Compression::zstd`] writes bodies of at least
//! [`min_size`](Compression::min_size) bytes as zstd frames — only when
//! that makes them smaller — and every store with the feature reads them.

use std::fmt;

use crate::record::CorruptRecord;

#[cfg(feature = "compression")]
pub(super) use self::zstd_frames::Zstd;

/// How a store writes response bodies and message results: as they are
/// (the default) or, with the `compression` feature, compressed with zstd.
///
/// Compression is invisible to clients: fingerprints are taken before it,
/// and a replay sends the original bytes. Every reader built with the
/// feature decompresses what any writer compressed (with a dictionary only
/// if it was given that dictionary too); a reader without the feature
/// refuses such a record with an error that names the feature.
///
/// # Examples
///
/// ```
/// use tower_idempotency::codec::Compression;
///
/// let none = Compression::none();
/// # #[cfg(feature = "compression")]
/// let zstd = Compression::zstd(1).min_size(1024);
/// # let _ = none;
/// ```
#[derive(Clone)]
pub struct Compression {
    #[cfg(feature = "compression")]
    pub(super) zstd: Option<std::sync::Arc<Zstd>>,
    /// The largest body compressed, and the most a frame may expand to.
    max_body: usize,
}

impl Default for Compression {
    fn default() -> Self {
        Self {
            #[cfg(feature = "compression")]
            zstd: None,
            max_body: DEFAULT_MAX_BODY,
        }
    }
}

/// The layer's default largest stored body, 1 MiB.
const DEFAULT_MAX_BODY: usize = 1 << 20;

impl Compression {
    /// Bodies are stored as they are.
    pub fn none() -> Self {
        Self::default()
    }

    /// The largest body this store compresses, and the most a compressed
    /// body may decompress to when read (default 1 MiB, the layer's
    /// default [`max_stored_body`](crate::IdempotencyLayer::max_stored_body)):
    /// a record whose frame claims more is corrupt — a tampered record
    /// must not make a replay allocate what it says. A larger body is
    /// stored as it is. Set it to the layer's `max_stored_body` if you
    /// raised that, on every instance that reads the records.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::codec::Compression;
    ///
    /// # #[cfg(feature = "compression")]
    /// let compression = Compression::zstd(1).max_body(8 << 20);
    /// # #[cfg(feature = "compression")]
    /// # let _ = compression;
    /// ```
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// Compresses `body` if this setting says so and it pays; `None` to
    /// store it as it is.
    pub(super) fn compress(&self, body: &[u8]) -> Option<Vec<u8>> {
        #[cfg(feature = "compression")]
        if let Some(zstd) = &self.zstd
            && body.len() <= self.max_body
        {
            return zstd.compress(body);
        }
        let _ = body;
        None
    }

    /// The body a compressed field holds.
    pub(super) fn decompress(&self, frame: &[u8]) -> Result<Vec<u8>, CorruptRecord> {
        #[cfg(feature = "compression")]
        return zstd_frames::decompress(self.zstd.as_deref(), frame, self.max_body);
        #[cfg(not(feature = "compression"))]
        {
            let _ = frame;
            Err(CorruptRecord(
                "the body is zstd-compressed: build tower-idempotency with the `compression` \
                 feature to read it",
            ))
        }
    }
}

impl fmt::Debug for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        #[cfg(feature = "compression")]
        if let Some(zstd) = &self.zstd {
            return f
                .debug_struct("Compression")
                .field("zstd", zstd)
                .field("max_body", &self.max_body)
                .finish();
        }
        f.debug_struct("Compression::None")
            .field("max_body", &self.max_body)
            .finish()
    }
}

#[cfg(feature = "compression")]
mod zstd_frames {
    use std::{cell::RefCell, fmt, num::NonZeroU32, sync::Arc};

    use zstd::zstd_safe::{self, CCtx, CDict, DCtx, DDict};

    use super::Compression;
    use crate::record::CorruptRecord;

    pub(in super::super) struct Zstd {
        level: i32,
        min_size: usize,
        /// The dictionary new frames are written with.
        writer: Option<(NonZeroU32, CDict<'static>)>,
        /// Every dictionary frames may name: the writer's and earlier ones.
        readers: Vec<(NonZeroU32, DDict<'static>)>,
    }

    thread_local! {
        /// Contexts are reused: creating one costs more than compressing a
        /// small body.
        static CONTEXTS: RefCell<(CCtx<'static>, DCtx<'static>)> =
            RefCell::new((CCtx::create(), DCtx::create()));
    }

    impl Compression {
        /// zstd at `level` (1 to 19; 1 to 3 suit a request path) for
        /// bodies of 1 KiB and more.
        ///
        /// # Examples
        ///
        /// ```
        /// use tower_idempotency::codec::Compression;
        ///
        /// let compression = Compression::zstd(1);
        /// # let _ = compression;
        /// ```
        pub fn zstd(level: i32) -> Self {
            Self {
                zstd: Some(Arc::new(Zstd {
                    level,
                    min_size: 1024,
                    writer: None,
                    readers: Vec::new(),
                })),
                ..Self::default()
            }
        }

        /// Bodies shorter than `bytes` are stored as they are (default
        /// 1 KiB: shorter JSON rarely shrinks without a dictionary).
        pub fn min_size(self, bytes: usize) -> Self {
            self.with(|zstd| zstd.min_size = bytes)
        }

        /// Compresses with a trained zstd dictionary (e.g. `zstd --train`
        /// over a few hundred of your responses): small JSON objects that
        /// share their field names shrink to a fraction. Every store that
        /// reads these records must be given the same dictionary (or get it
        /// through [`read_dictionary`](Self::read_dictionary) after a
        /// change).
        ///
        /// # Panics
        ///
        /// If `dictionary` is not a trained zstd dictionary (it has no
        /// dictionary id, so its frames could not say what they need).
        pub fn dictionary(self, dictionary: &[u8]) -> Self {
            let id = dictionary_id(dictionary);
            self.with(|zstd| {
                zstd.writer = Some((id, CDict::create(dictionary, zstd.level)));
            })
            .read_dictionary(dictionary)
        }

        /// Also reads frames written with `dictionary`, e.g. the one used
        /// before [`dictionary`](Self::dictionary) changed, until the
        /// records written with it have expired.
        ///
        /// # Panics
        ///
        /// If `dictionary` is not a trained zstd dictionary.
        pub fn read_dictionary(self, dictionary: &[u8]) -> Self {
            let id = dictionary_id(dictionary);
            self.with(|zstd| zstd.readers.push((id, DDict::create(dictionary))))
        }

        fn with(mut self, change: impl FnOnce(&mut Zstd)) -> Self {
            let zstd = self
                .zstd
                .as_mut()
                .and_then(Arc::get_mut)
                .expect("configure Compression::zstd(..) before sharing it");
            change(zstd);
            self
        }
    }

    fn dictionary_id(dictionary: &[u8]) -> NonZeroU32 {
        zstd_safe::get_dict_id_from_dict(dictionary).expect(
            "not a trained zstd dictionary (no dictionary id): train one with `zstd --train`",
        )
    }

    impl Zstd {
        pub(super) fn compress(&self, body: &[u8]) -> Option<Vec<u8>> {
            if body.len() < self.min_size {
                return None;
            }
            let mut frame = Vec::with_capacity(zstd_safe::compress_bound(body.len()));
            let written = CONTEXTS.with_borrow_mut(|(cctx, _)| match &self.writer {
                Some((_, dictionary)) => cctx.compress_using_cdict(&mut frame, body, dictionary),
                None => cctx.compress(&mut frame, body, self.level),
            });
            (written.is_ok() && frame.len() < body.len()).then_some(frame)
        }
    }

    /// The body `frame` holds, if it says it is at most `max_body` bytes.
    pub(super) fn decompress(
        zstd: Option<&Zstd>,
        frame: &[u8],
        max_body: usize,
    ) -> Result<Vec<u8>, CorruptRecord> {
        let size = match zstd_safe::get_frame_content_size(frame) {
            Ok(Some(size)) if size <= max_body as u64 => size as usize,
            Ok(Some(_)) => {
                return Err(CorruptRecord(
                    "compressed body larger than the store's max_body: a corrupt record, or \
                     one written by a store configured for larger bodies",
                ));
            }
            _ => return Err(CorruptRecord("compressed body without a valid size")),
        };
        let dictionary = match zstd_safe::get_dict_id_from_frame(frame) {
            None => None,
            Some(id) => Some(
                zstd.and_then(|z| z.readers.iter().find(|(known, _)| *known == id))
                    .map(|(_, dictionary)| dictionary)
                    .ok_or(CorruptRecord(
                        "the body was compressed with a zstd dictionary this store was not \
                         given: configure it with Compression::read_dictionary",
                    ))?,
            ),
        };
        let mut body = Vec::with_capacity(size);
        let read = CONTEXTS.with_borrow_mut(|(_, dctx)| match dictionary {
            Some(dictionary) => dctx.decompress_using_ddict(&mut body, frame, dictionary),
            None => dctx.decompress(&mut body, frame),
        });
        match read {
            Ok(n) if n == size => Ok(body),
            _ => Err(CorruptRecord("compressed body does not decompress")),
        }
    }

    impl fmt::Debug for Zstd {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("Compression::Zstd")
                .field("level", &self.level)
                .field("min_size", &self.min_size)
                .field("dictionary", &self.writer.as_ref().map(|(id, _)| id))
                .field(
                    "read_dictionaries",
                    &self.readers.iter().map(|(id, _)| id).collect::<Vec<_>>(),
                )
                .finish()
        }
    }
}
